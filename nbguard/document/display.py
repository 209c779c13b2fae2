"""The display mixin of result objects: they show themselves anywhere IPython can display.

The formats are the render layer's: the package facade (``nbguard/__init__``, which every import of
nbguard runs first) registers them here with ``set_formatters``, so this bottom layer imports no renderer.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from .outward import dataclass_repr, outward, outward_text

Bundle = Callable[[dict[str, Any]], dict[str, Any]]
Text = Callable[[dict[str, Any]], str]
_formatters: dict[str, Any] = {}


def set_formatters(bundle: Bundle, text: Text) -> None:
    """The render layer's MIME bundle and plain text of a document, for every ``Displayable``."""
    _formatters.update(bundle=bundle, text=text)


class Displayable:
    """Result objects (audit results, watches, diagnoses, reports) implement ``to_document()``;
    this mixin turns it into ``text/plain``, ``text/html`` and the nbguard MIME data."""

    def to_document(self) -> dict[str, Any]:  # pragma: no cover - abstract
        raise NotImplementedError

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        bundle = _formatters.get("bundle")
        if bundle is None:  # nbguard.render was never imported: the document as JSON is all there is
            return {"application/json": outward(self.to_document())}
        return bundle(outward(self.to_document()))  # the document redacted before any format sees it

    def __str__(self) -> str:
        text = _formatters.get("text")
        return outward_text(text(self.to_document()) if text is not None
                            else json.dumps(self.to_document(), default=str))

    def __repr__(self) -> str:
        """The dataclass repr (a result class declares ``@dataclass(repr=False)`` to keep this one), redacted:
        ``repr([nbguard.explain(exc)])`` quotes the exception."""
        return dataclass_repr(self)
