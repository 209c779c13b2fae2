"""Applying a fix the session measured as "not enough" is refused unless forced: it would leave the run failing.

A verdict belongs to one exact cell (the fix id and the text that ran, as ``session.latest_verdict`` reads it);
the refusal names that verdict's reason and the fix to make instead: the one ``recommended_fix`` picks among the
cells verified beside it.
"""
from __future__ import annotations

from ..document.view import FixView, fix_verdicts, recommended_fix
from ..session import SESSION, latest_verdict


class FixNotEnough(ValueError):
    """The cell about to be applied was run on the failing step and left it failing; ``force=True`` applies it."""


def _instead(fix_id: str, code: str) -> FixView | None:
    """The recommended fix among the verdicts of the newest document that ran this cell beside others and
    verified one (a later ``verify(event, fix_id)`` of this cell alone recommends nothing)."""
    for doc in reversed(SESSION.documents()):
        verdicts = fix_verdicts(doc)
        if (fix_id, code) in verdicts:
            views = [FixView(fid, code=cell, verdict=v) for (fid, cell), v in verdicts.items() if fid != fix_id]
            better = recommended_fix(views)
            if better is not None:
                return better
    return None


def refusal(fix_id: str, code: str, *, python: bool = True) -> str | None:
    """Why applying exactly ``code`` of ``fix_id`` is refused, and what to do; None when it is not refused.

    ``python``: the advice names ``nbguard.fixes.apply(..., force=True)`` (else the magic's ``--force``)."""
    verdict = latest_verdict(fix_id, code)
    if verdict is None or verdict.status != "not-enough":
        return None
    better = _instead(fix_id, code)
    force = "force=True" if python else "--force"
    instead = (f"make {better.id} instead (verified {better.verdict.where}: "
               + (f"nbguard.fixes.apply({better.id!r}, ...)" if python else f"%nbguard fix {better.id} --apply")
               + "), or ") if better is not None and better.verdict is not None else ""
    why = f": {verdict.detail}" if verdict.detail else ""
    return (f"{fix_id} was not applied: this cell was not enough {verdict.where}{why}. Applied, the run would fail "
            f"the same way; {instead}pass {force} to apply it anyway")
