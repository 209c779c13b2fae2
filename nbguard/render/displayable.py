"""The display mixin of result objects: they show themselves anywhere IPython can display."""
from __future__ import annotations

from typing import Any

from . import mime_bundle
from .text import render_text


class Displayable:
    """Result objects (audit results, watches, diagnoses, reports) implement ``to_document()``;
    this mixin turns it into ``text/plain``, ``text/html`` and the nbguard MIME data."""

    def to_document(self) -> dict[str, Any]:  # pragma: no cover - abstract
        raise NotImplementedError

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        return mime_bundle(self.to_document())

    def __str__(self) -> str:
        return render_text(self.to_document())
