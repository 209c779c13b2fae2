"""Renderers of the nbguard v1 document: text, static HTML, heatmap PNGs and the MIME bundle.

Every result object displays through :func:`mime_bundle`, so a saved notebook, nbconvert's HTML,
GitHub's viewer and a closed kernel still show it; the JupyterLab extension reads the
``application/vnd.nbguard.v1+json`` entry of the same bundle.
"""
from __future__ import annotations

from typing import Any

from ..findings import MIME_TYPE
from .data import check_json, encode_document
from .heatmap import activations_png, heatmap_png
from .html import render_html
from .series import series_png
from .text import render_text

__all__ = ["MIME_TYPE", "activations_png", "encode_document", "heatmap_png", "mime_bundle", "render_html",
           "render_text", "series_png"]


def mime_bundle(doc: dict[str, Any]) -> dict[str, Any]:
    """{"text/plain", "text/html", MIME_TYPE} for ``doc``; the JSON entry is strict JSON
    (non-finite floats encoded as strings, numpy/torch values as plain numbers).

    Secrets are redacted (``nbguard.reporting.redact``): a displayed output is written into the
    .ipynb file, which gets shared like any report.
    """
    if not isinstance(doc, dict):
        raise TypeError(f"doc must be an nbguard document (dict from nbguard.findings.document), got {type(doc).__name__}")
    from ..reporting.redact import redact  # lazy: reporting imports render

    data = redact(encode_document(doc), home=False)
    check_json(data)
    return {"text/plain": render_text(data), "text/html": render_html(data), MIME_TYPE: data}
