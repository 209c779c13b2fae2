"""The watch's event text and the folding of GradScaler skip streaks (pure functions, no watch state)."""
from __future__ import annotations

from typing import Any

from ..document.model import fold_skip_streaks as fold_streaks
from ..findings import Event


def event_message(kind: str, cause: str | None, origins: list, evidence: dict[str, Any]) -> str:
    """One line for a watch event: what happened and, once localised, where (the step is shown apart)."""
    what = {
        "nonfinite-loss": "non-finite loss",
        "nonfinite-grad": "non-finite gradient",
        "skipped-steps": f"GradScaler skipped {evidence.get('consecutive_skipped')} optimizer steps in a row "
                         f"(loss scale down to {evidence.get('loss_scale')})",
        "scaler-skip": f"GradScaler skipped this step: non-finite gradients at loss scale "
                       f"{evidence.get('loss_scale')}",
    }.get(kind, kind)
    text = what  # renderers and summary() show the step themselves
    if cause == "no-supervised-tokens":
        return text + ": a micro-batch has every label -100, so the mean loss is 0/0"
    if origins:
        o = origins[0]
        text += f": {cause} in {o.module or '<model>'} ({o.phase}"
        text += f", {o.dtype})" if o.dtype else ")"
        if o.micro_batch:
            text += f", micro-batch {o.micro_batch}"
        if o.evidence.get("bypassed_children"):
            text += "; made inside its own forward: a fused kernel bypassed its children's hooks"
    elif cause == "not-reproducible" and evidence.get("next_steps"):
        text += f" (not reproduced by an eager replay; next: {evidence['next_steps'][0].split(':')[0]})"
    elif cause:
        text += f" ({cause})"
    return text


def skip_streaks(events: list[Event]) -> list[dict[str, Any]]:
    """Each GradScaler skip streak as data for the views: its steps, length, and the cause and
    module the replay of its first step found."""
    out = []
    for first, last, count in fold_skip_streaks(events):
        if first.kind != "scaler-skip":
            continue
        origin = first.origins[0] if first.origins else None
        out.append({"first_step": first.step, "last_step": last, "count": count, "cause": first.cause,
                    "module": origin.module if origin else None, "loss_scale": first.evidence.get("loss_scale")})
    return out


def fold_skip_streaks(events: list[Event]) -> list[tuple[Event, int, int]]:
    """(first event, last step, count) per GradScaler streak; see ``nbguard.document.model``."""
    return fold_streaks(events, lambda e: (e.kind, e.step, e.evidence.get("streak_start")))
