"""Renderers of the nbguard v1 document: text, static HTML, heatmap PNGs and the MIME bundle.

Every result object displays through :func:`mime_bundle`, so a saved notebook, nbconvert's HTML,
GitHub's viewer and a closed kernel still show it; the JupyterLab extension reads the
``application/vnd.nbguard.v1+json`` entry of the same bundle.
"""
from __future__ import annotations

from typing import Any

from ..document import MIME_TYPE
from ..document.codec import check_json, encode_document
from ..document.redact import redact
from ..document.view import view, without_view
from .heatmap import activations_png, heatmap_png, update_norms_png
from .html import render_html
from .series import series_png
from .text import format_view, render_text

__all__ = ["MIME_TYPE", "activations_png", "encode_document", "heatmap_png", "mime_bundle", "render_html",
           "render_text", "series_png", "update_norms_png"]


def mime_bundle(doc: dict[str, Any]) -> dict[str, Any]:
    """{"text/plain", "text/html", MIME_TYPE} for ``doc``; the JSON entry is strict JSON
    (non-finite floats encoded as strings, numpy/torch values as plain numbers).

    Secrets are redacted (``nbguard.document.redact``): a displayed output is written into the
    .ipynb file, which gets shared like any report.
    """
    if not isinstance(doc, dict):
        raise TypeError(f"doc must be an nbguard document (dict from nbguard.findings.document), got {type(doc).__name__}")
    data = redact(encode_document(without_view(doc)))
    check_json(data)
    presented = view(data)
    # The Lab extension lays out the same view the text and HTML below are made of, so the three
    # cannot disagree; the document itself stays beside it for the heatmaps and for reports.
    payload = {**data, "view": presented.to_dict()}
    return {"text/plain": format_view(presented), "text/html": render_html(data), MIME_TYPE: payload}
