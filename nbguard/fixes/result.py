"""What applying a fix did, as data."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..findings import Displayable, document, jsonable


@dataclass(repr=False)  # repr: through the output boundary (Displayable / dataclass_repr)
class FixResult(Displayable):
    fix: str
    changed: Any  # a dict or list describing each change; empty when there was nothing to do
    code: str  # the equivalent notebook cell

    @property
    def changed_anything(self) -> bool:
        return bool(self.changed)

    def to_dict(self) -> dict[str, Any]:
        return {"fix": self.fix, "changed": jsonable(self.changed), "code": self.code}

    def to_document(self) -> dict[str, Any]:
        return document("fix", title=f"nbguard fix: {self.fix}", fixes_applied=[self.to_dict()])
