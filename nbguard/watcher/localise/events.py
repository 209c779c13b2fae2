"""The watch's events: their construction (localised by replay), their text, and the folding of
GradScaler skip streaks for the views."""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from ...document.model import fold_skip_streaks as fold_streaks
from ...findings import Event
from ...step.capture import MicroBatch
from ..reads.sentinel import StepStats
from .replay import Replayer


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
        if o.evidence.get("fused_loss"):  # the loss read this module's weight without running it
            text += f"; read by {o.evidence['fused_loss']} in {o.evidence.get('read_by')}, logits never materialised"
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


class Localiser:
    """Builds a watch event for the current step, localised by an eager replay where the budget allows.

    The replay runs the step's captured micro-batches again with hooks on every module to name where
    the NaN/Inf was born (:mod:`.replay`). Non-finite events and GradScaler skip streaks have their
    own budgets (``WatchSettings.max_replays`` each): a fresh fp16 run's few start-up skips do not use
    up the replays a later NaN needs.
    """

    def __init__(self, model: torch.nn.Module, max_replays: int, paused: Callable[[], AbstractContextManager[None]]):
        self.model = model
        self.max_replays = max_replays
        self.paused = paused  # the watch looks away while the replay runs
        self.replayer: Any = None  # a Replayer, made at the first replay
        self.replays = 0  # replays of nonfinite-loss/grad events
        self.skip_replays = 0  # replays of the first step of each GradScaler skip streak (own budget)

    def event(self, kind: str, step: int, stats: StepStats, groups: list[str], micro_batches: list[MicroBatch],
              extra: dict | None = None, budget: str = "nonfinite", replay: bool = True) -> Event:
        """The event of ``kind`` at ``step``: its evidence from the read, its cause and origins from
        the batches (every label -100) or from a replay (``replay=False``: never)."""
        evidence: dict[str, Any] = dict(extra or {})
        evidence.update({"loss": stats.loss, "total_grad_norm": stats.total_grad_norm,
                         "nonfinite_groups": [g for g, v in zip(groups, stats.grad_norm) if not math.isfinite(v)],
                         "micro_batches": len(micro_batches)})
        if stats.loss_scale is not None:
            evidence["loss_scale"] = stats.loss_scale
        cause, origins = None, []
        empty = [mb.index for mb in micro_batches if mb.has_no_supervised_tokens()]
        # 0/0 shows in the loss, or only in the gradients when the loss is computed outside the model.
        if empty and kind in ("nonfinite-loss", "nonfinite-grad"):
            cause = "no-supervised-tokens"
            evidence["micro_batches_without_labels"] = empty
        elif replay and micro_batches and self._take_replay(budget):
            started = time.perf_counter()
            try:
                found = self._replay(micro_batches)
            except Exception as exc:  # e.g. out of memory: the event stands, unlocalised
                evidence["replay_error"] = f"{type(exc).__name__}: {exc}"
            else:
                cause, origins = found.cause, found.origins
                evidence.update(found.evidence)
            evidence["replay_seconds"] = time.perf_counter() - started
        return Event(kind, step, event_message(kind, cause, origins, evidence), cause, origins, evidence)

    def _take_replay(self, budget: str) -> bool:
        """Skip streaks (a fresh fp16 run has a few at start-up) do not use up the NaN events' replays."""
        used = self.skip_replays if budget == "skip" else self.replays
        if used >= self.max_replays:
            return False
        if budget == "skip":
            self.skip_replays += 1
        else:
            self.replays += 1
        return True

    def _replay(self, micro_batches: list[MicroBatch]) -> Any:
        if self.replayer is None:
            self.replayer = Replayer(self.model)
        with self.paused():
            return self.replayer.run(micro_batches)
