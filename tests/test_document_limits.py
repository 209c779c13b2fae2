"""#40 finding 6: documents are bounded (groups x steps, nesting, list lengths, bytes) when they are built, saved and
loaded; an over-limit saved document is refused with a message naming the limit, never a hang, a gigabyte or a
RecursionError, and the rest of the notebook still exports."""
from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
pytest.importorskip("nbconvert")

from nbguard.document import codec  # noqa: E402
from nbguard.document.codec import (  # noqa: E402
    DEEPER,
    MAX_DEPTH,
    MAX_GRID_CELLS,
    MAX_LIST,
    DocumentLimitError,
    check_json,
    check_limits,
    encode_document,
    load_document_text,
)
from nbguard.document.grid import decode_grid  # noqa: E402
from nbguard.document.model import document  # noqa: E402
from nbguard.findings import MIME_TYPE  # noqa: E402
from nbguard.reporting.nbconvert import NbguardExporter  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def watch_94kb() -> dict:
    """The saved watch of the issue: 8000 groups x 8000 steps, no values (~100 KB of JSON)."""
    history = {"groups": [f"m.l{i}" for i in range(8000)], "steps": list(range(8000)), "grad_norm": []}
    return document("watch", title="w", history=history, events=[])


def nested(depth: int):
    node: object = "x"
    for _ in range(depth):
        node = {"a": node}
    return node


def audit_with_evidence(evidence) -> dict:
    return document("audit", title="a", findings=[{"rule": "some-rule", "severity": "warning", "title": "t",
                                                   "detail": "d", "evidence": evidence, "fixes": []}])


def notebook(*payloads) -> str:
    """An .ipynb's text with one cell per payload, shown as nbguard's MIME data (written as json.dumps does:
    nbformat's own nodes recurse twice per level and cannot even build a 600-deep one under pytest)."""
    cells = [{"cell_type": "code", "id": f"c{i}", "metadata": {}, "source": "x", "execution_count": i + 1,
              "outputs": [{"output_type": "display_data", "metadata": {},
                           "data": {MIME_TYPE: payload, "text/plain": "nbguard"}}]}
             for i, payload in enumerate(payloads)]
    return json.dumps({"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": cells})


def export(text: str, fmt: str = "json") -> str:
    """``jupyter nbconvert --to nbguard``'s path: the exporter reads the notebook file."""
    body, _ = NbguardExporter(report_format=fmt).from_file(io.StringIO(text))
    return body


def test_the_limits_have_one_definition_mirrored_in_the_lab():
    ts = (ROOT / "labextension" / "src" / "limits.ts").read_text(encoding="utf-8")
    mirrored = {name: int(value.replace("_", "")) for name, value in
                re.findall(r"export const (MAX_[A-Z_]+) = ([0-9_]+);", ts)}
    assert mirrored == codec.LIMITS


def test_a_94kb_watch_of_8000_groups_x_8000_steps_is_refused_naming_the_limit():
    doc = watch_94kb()
    assert len(json.dumps(doc)) < 150_000
    with pytest.raises(DocumentLimitError, match="MAX_GRID_CELLS"):
        decode_grid([], 8000, 8000)  # before: ~1 GB allocated for 64M cells
    with pytest.raises(DocumentLimitError, match=r"8000 groups x 8000 steps .* limit of 8388608 cells"):
        check_limits(doc)
    body = json.loads(export(notebook(doc, audit_with_evidence({"k": 1}))))
    notes = " ".join(body.get("notes", []))
    assert "cell 1 was not read" in notes and "MAX_GRID_CELLS" in notes
    assert [e["kind"] for e in body["entries"]] == ["audit"]  # the other output still exports


def test_evidence_nested_600_deep_is_refused_at_load_and_the_export_goes_on():
    nb = notebook(audit_with_evidence(nested(600)), audit_with_evidence({"kept": True}))
    for fmt in ("json", "html", "md"):
        body = export(nb, fmt)  # before: RecursionError for the whole export
        assert "limit of 64 levels" in body  # (Markdown escapes the underscore of MAX_DEPTH)
    body = json.loads(export(nb))
    assert len(body["entries"]) == 1 and body["entries"][0]["findings"][0]["evidence"] == {"kept": True}


def test_json_text_nested_100000_deep_is_refused_before_parsing():
    text = "[" * 100_000 + "]" * 100_000
    with pytest.raises(DocumentLimitError, match="nested 100000 levels deep"):
        load_document_text(text)
    assert "MAX_DEPTH" in export(notebook(text))


def test_built_documents_are_cut_to_the_limits_and_say_so():
    built = encode_document({"evidence": nested(600), "files": [f"f{i}" for i in range(MAX_LIST + 5)]})
    check_limits(built)  # what is built is within the limits
    depth, node = 1, built["evidence"]
    while isinstance(node, dict):
        depth, node = depth + 1, node["a"]
    assert node == DEEPER and depth == MAX_DEPTH
    assert len(built["files"]) == MAX_LIST and "6 more items" in built["files"][-1]
    from nbguard.render import mime_bundle

    bundle = mime_bundle(audit_with_evidence(nested(600)))  # displayed (and so saved) without a RecursionError
    check_limits(bundle[MIME_TYPE])


def test_saving_an_over_limit_grid_is_refused_naming_the_limit():
    with pytest.raises(DocumentLimitError, match="MAX_GRID_CELLS"):
        check_json(watch_94kb())
    assert 4096 * 2048 <= MAX_GRID_CELLS  # a default-capacity history of 4096 groups fits
    check_limits(document("watch", history={"groups": ["g"] * 4096, "steps": list(range(2048))}))
    assert MAX_DEPTH >= 32
