"""Showing nbguard documents: one output per result, that survives a closed kernel.

Every output is a MIME bundle with ``text/plain``, a static ``text/html`` and the
``application/vnd.nbguard.v1+json`` document; when a widget is shown it rides in the SAME output
as ``application/vnd.jupyter.widget-view+json``, so a live kernel shows the widget and a saved
notebook, nbconvert, GitHub or the lab extension show the static views.
"""
from __future__ import annotations

import sys
import uuid
from typing import Any

from ..document.outward import outward, outward_text

WIDGET_VIEW_MIME = "application/vnd.jupyter.widget-view+json"
NO_WIDGETS_HINT = (
    "Interactive view unavailable (ipywidgets is not installed or has no front end here): "
    "`pip install ipywidgets` and restart the kernel for the cards and buttons."
)


def new_output_id() -> str:
    return uuid.uuid4().hex


def with_output_id(doc: dict[str, Any], output_id: str | None = None) -> dict[str, Any]:
    """A copy of ``doc`` carrying the ``output_id`` the lab extension uses to find the owning cell."""
    doc = dict(doc)
    doc["output_id"] = output_id or doc.get("output_id") or new_output_id()
    return doc


def in_colab() -> bool:
    return "google.colab" in sys.modules


_colab_widgets_enabled = False


def enable_colab_widgets() -> bool:
    """Turn on Colab's custom widget manager (once per kernel); True when it is on."""
    global _colab_widgets_enabled
    if _colab_widgets_enabled:
        return True
    if not in_colab():
        return False
    try:
        from google.colab import output
    except ImportError:
        return False
    enable = getattr(output, "enable_custom_widget_manager", None)
    if enable is None:
        return False
    enable()
    _colab_widgets_enabled = True
    return True


def widget_view(widget) -> dict[str, Any]:
    """The widget-view entry of a bundle, for ipywidgets 7 (``_ipython_display_``) and 8 (``_repr_mimebundle_``)."""
    model_id = getattr(widget, "model_id", None) or getattr(widget, "_model_id", None)
    return {WIDGET_VIEW_MIME: {"version_major": 2, "version_minor": 0, "model_id": model_id}}


def bundle(doc: dict[str, Any], widget=None, hint: str | None = None) -> dict[str, Any]:
    """The MIME bundle of ``doc`` (plus the widget view when given, plus a hint line when given)."""
    from ..render import mime_bundle

    data = dict(mime_bundle(outward(doc)))
    hint = outward_text(hint) if hint else hint
    if hint:
        data["text/plain"] = f"{data['text/plain']}\n\n{hint}"
        data["text/html"] = f"{data['text/html']}<p class=\"nbguard-hint\"><em>{_escape(hint)}</em></p>"
    if widget is not None:
        data.update(widget_view(widget))
    return data


def publish(doc: dict[str, Any], widget=None, hint: str | None = None):
    """Display ``doc`` (with ``widget`` when given) as one output; returns its DisplayHandle.

    Always through ``display()``, never as a cell's return value: in Colab an execute_result
    misses the widget metadata Colab adds to display_data messages.
    """
    from IPython.display import display

    if widget is not None:
        enable_colab_widgets()
    handle = display(bundle(doc, widget, hint), raw=True, display_id=True)
    if widget is not None and hasattr(widget, "_handle_displayed"):
        widget._handle_displayed()  # what the widget's own display path would fire (on_displayed callbacks)
    return handle


def republish(handle, doc: dict[str, Any], widget=None, hint: str | None = None) -> None:
    """Replace an output in place (same display id): the saved notebook keeps the latest static view."""
    if handle is not None:
        handle.update(bundle(doc, widget, hint), raw=True)


def _escape(text: str) -> str:
    import html

    return html.escape(text, quote=True)
