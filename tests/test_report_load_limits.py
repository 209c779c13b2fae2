"""Report.load reads a saved report as untrusted data: within the document limits, never a FIFO."""
from __future__ import annotations

import json
import os

import pytest
from report_helpers import planted_watch_document

from nbguard.document.codec import MAX_DEPTH, DocumentLimitError
from nbguard.introspect.user_files import UserFileError
from nbguard.reporting.report import Report, build_report


def test_a_saved_report_loads_back(tmp_path):
    report = build_report(watch=planted_watch_document())
    path = report.save(tmp_path / "report.json")
    assert Report.load(path).to_dict() == report.to_dict()  # the bounded read keeps every value


def test_a_report_nested_past_the_limit_is_refused_with_the_limit_named(tmp_path):
    doc = build_report(watch=planted_watch_document()).to_dict()
    deep: dict = {}
    node = deep
    for _ in range(600):  # 600 levels: json.loads alone would recurse through all of them
        node["x"] = {}
        node = node["x"]
    doc["entries"][0]["events"][0]["evidence"]["nested"] = deep
    path = tmp_path / "deep.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(DocumentLimitError, match=f"over the limit of {MAX_DEPTH} levels"):
        Report.load(path)


def test_a_fifo_is_refused_instead_of_hanging(tmp_path):
    path = tmp_path / "report.json"
    os.mkfifo(path)
    with pytest.raises(UserFileError, match="report.json"):
        Report.load(path)
