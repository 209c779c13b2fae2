"""Exported reports: self-contained HTML, Markdown for a GitHub issue, versioned JSON;
redaction of secrets; an nbconvert exporter (``jupyter nbconvert --to nbguard``).

The JSON schema of the v1 document is ``schema.json`` beside this file (:func:`schema`).
"""
from __future__ import annotations

import json
from functools import cache
from pathlib import Path

from .collect import merge_documents
from .redact import redact
from .report import FORMATS, Report, build_report

SCHEMA_PATH = Path(__file__).with_name("schema.json")


@cache
def _schema_text() -> str:
    return SCHEMA_PATH.read_text(encoding="utf-8")


def schema() -> dict:
    """The JSON Schema (draft 2020-12) of the v1 document every nbguard payload follows."""
    return json.loads(_schema_text())


__all__ = ["FORMATS", "Report", "build_report", "merge_documents", "redact", "schema", "SCHEMA_PATH"]
