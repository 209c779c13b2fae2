"""The GradScaler's skipped steps as a detector: one ``scaler-skip`` event per skipped step, and a
``skipped-steps`` alarm when a streak (or a collapsing loss scale) crosses the line.

The first skip of a streak is localised by a replay (its own replay budget: a fresh fp16 run has a
few skips at start-up); the later ones point at it through ``streak_start``, so views fold a streak
into one line. The GradScaler's verdict is all-reduced, so across ranks every rank sees the same
skips: the events are agreed, and under policy stop the alarm ends training on every rank.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...findings import Event
from ..core.pipeline import Detector, StepView
from ..distributed.ranks import RANK_EVIDENCE
from ..localise.events import event_message
from .thresholds import SkipStreak, WatchSettings

# localise(kind, extra evidence, replay budget): this step's event, localised by replay where the
# budget allows (across ranks: the agreed event)
Localise = Callable[[str, dict[str, Any], str], Event]


class ScalerSkips(Detector):
    name = "scaler-skips"
    agreed = True

    def __init__(self, settings: WatchSettings, localise: Localise):
        self.skips = SkipStreak(settings)
        self.first: Event | None = None  # the scaler-skip event that opened the current streak
        self._localise = localise

    def update(self, view: StepView) -> list[Event]:
        if view.scaler_skipped is None:  # no GradScaler bound
            return []
        events = [self._skip_event(view)] if view.scaler_skipped else []
        streak = self.skips.update(view.scaler_skipped, view.loss_scale, view.step)
        if streak is not None:
            events.append(self._streak_event(view, streak))
        return events

    def stops_training(self, event: Event) -> bool:
        return event.kind == "skipped-steps"

    def _skip_event(self, view: StepView) -> Event:
        """One event per step the GradScaler skipped. The first of a streak is localised by replay;
        the others point at it (``streak_start``)."""
        if self.skips.streak == 0:
            self.first = self._localise("scaler-skip", {"streak_start": view.step}, "skip")
            return self.first
        start = self.skips.start
        evidence = {"streak_start": start, "loss": view.loss, "total_grad_norm": view.total_grad_norm,
                    "loss_scale": view.loss_scale, "localised_at_step": start}
        return Event("scaler-skip", view.step, event_message("scaler-skip", None, [], evidence), evidence=evidence,
                     rank=self.first.rank if self.first is not None else None)

    def _streak_event(self, view: StepView, streak: dict) -> Event:
        """The alarm after a streak: localised by the replay of the streak's first step when it had one."""
        first = self.first
        if first is None or first.cause is None:
            return self._localise("skipped-steps", streak, "nonfinite")
        evidence = {**streak, "streak_start": first.step, "localised_at_step": first.step,
                    **{k: v for k, v in first.evidence.items() if k in ("micro_batch", "replay_seconds")}}
        evidence.update({"loss": view.loss, "total_grad_norm": view.total_grad_norm,
                         "loss_scale": view.loss_scale})
        evidence.update({k: v for k, v in first.evidence.items() if k in RANK_EVIDENCE})
        return Event("skipped-steps", view.step, event_message("skipped-steps", first.cause, first.origins, evidence),
                     first.cause, list(first.origins), evidence, rank=first.rank)
