"""A diagnosis: what a known error signature means and which fixes apply."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .. import fixes as fix_registry
from ..findings import Displayable, FixOffer, document, jsonable


def exception_text(exc: BaseException) -> str:
    """``TypeName: message`` on one line, the way a traceback's last line reads."""
    message = str(exc).strip()
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


@dataclass(repr=False)  # repr: through the output boundary (Displayable / dataclass_repr)
class Diagnosis(Displayable):
    signature: str  # the stable id of the rule that recognised the error
    title: str
    detail: str
    exception: str  # the exception as text (the exception object itself is not kept: it holds frames)
    fixes: list[str] = field(default_factory=list)
    evidence: dict[str, Any] = field(default_factory=dict)
    fix_options: dict[str, dict[str, Any]] = field(default_factory=dict)  # e.g. switch-precision's "to"
    verification: dict[str, Any] | None = None  # Verification.to_dict() when a watch captured the failing step

    def __post_init__(self) -> None:
        fix_registry.check_offered(self.fixes, f"error signature {self.signature!r}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "signature": self.signature,
            "title": self.title,
            "detail": self.detail,
            "exception": self.exception,
            "fixes": list(self.fixes),
            "evidence": jsonable(self.evidence),
            **({"verification": self.verification} if self.verification is not None else {}),
        }

    def offers(self) -> list[FixOffer]:
        """The fixes this diagnosis offers, with their options."""
        return [FixOffer(fix_id, dict(self.fix_options.get(fix_id, {}))) for fix_id in self.fixes]

    def fix_cells(self, names: dict[str, str] | None = None) -> dict[str, dict[str, str]]:
        """Each fix as a notebook cell written with the user's variable names.

        A fix that needs a name the caller did not give (TrainingArguments for a plain model) gets
        no cell rather than code naming a variable the user does not have.
        """
        if not self.fixes:
            return {}
        names = names or {}
        cells = {}
        for fix_id in self.fixes:
            fix = fix_registry.get(fix_id)
            try:
                code = fix_registry.code(fix_id, **names, **self.fix_options.get(fix_id, {}))
            except ValueError:  # it acts on an object the caller named no variable for (args, an optimizer)
                continue
            cells[fix_id] = {"title": fix.title, "code": code}
        return cells

    def to_document(self, names: dict[str, str] | None = None) -> dict[str, Any]:
        return document(
            "diagnosis",
            title=self.title,
            diagnoses=[self.to_dict()],
            fix_cells=self.fix_cells(names),
            **({"verification": self.verification} if self.verification is not None else {}),
        )
