"""Exported reports: self-contained HTML, Markdown for a GitHub issue, versioned JSON, and an
nbconvert exporter (``jupyter nbconvert --to nbguard``).

The document they write (schema, redaction, merging) is ``nbguard.document``.
"""
from __future__ import annotations

from ..document.merge import merge_documents
from ..document.redact import redact
from ..document.schema import SCHEMA_PATH, schema
from .report import FORMATS, Report, build_report

__all__ = ["FORMATS", "Report", "build_report", "merge_documents", "redact", "schema", "SCHEMA_PATH"]
