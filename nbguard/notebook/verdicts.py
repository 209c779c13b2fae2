"""What ``%nbguard fix`` says about the one cell it shows, inserts or applies.

A verdict belongs to one exact cell (fix id, options, target, names: its text). The line shows the
verdict of this very text; where the text never ran, it is run first on the failing step the watch
kept, when that step can still be re-run; otherwise the line says it was not verified, and never
borrows another variant's verdict.
"""
from __future__ import annotations

from typing import Any

from ..session import SESSION, latest_verdict, verified_variants


def _options_text(options: dict[str, Any]) -> str:
    return f" ({', '.join(f'{k}={v}' for k, v in options.items())})" if options else ""


def _verify_on_kept_step(fix_id: str, options: dict[str, Any]) -> str | None:
    """Run this cell on the newest failing step a live watch kept; why not, when it cannot."""
    from ..verifier import verify

    for watch in reversed(SESSION.watches):
        kept = watch.captured_step(None) if hasattr(watch, "captured_step") else None
        if kept is None:
            continue
        event, step = kept
        moved = step.weights_moved()
        if moved:
            return (f"the step the watch kept (step {event.step}) can no longer be re-run: the weights changed "
                    f"since ({moved[0]})")
        verify(event, fix_id, watch=watch, options={fix_id: options})
        return None
    return "no watch kept a failing step to run it on"


def cell_verdict_line(fix_id: str, options: dict[str, Any], code: str, names: dict[str, str]) -> str:
    """One line: the verdict of exactly ``code``, or why there is none."""
    SESSION.names = dict(names)  # a cell verified now is written in the names this cell uses
    verdict = latest_verdict(fix_id, code)
    why_not = None
    if verdict is None:  # this text never ran: run it on the failing step the watch kept, if it can be
        why_not = _verify_on_kept_step(fix_id, options)
        verdict = latest_verdict(fix_id, code)
    what = f"{fix_id}{_options_text(options)}"
    if verdict is not None:
        return f"nbguard: {what} {verdict.label} {verdict.where}" + (f": {verdict.detail}" if verdict.detail else "")
    if verified_variants(fix_id):
        return (f"nbguard: {what} is not verified: this cell never ran on the failing step, another variant of "
                f"{fix_id} did" + (f"; {why_not}" if why_not else ""))
    return f"nbguard: {what}: this cell was not run on a failing step, so it is not verified" + (
        f" ({why_not})" if why_not else "")
