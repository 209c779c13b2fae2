"""DeepSpeed's fp16 loss-scaler skips, read like a GradScaler's: from the messages it logs.

The fallback where the watch was not given the engine (a Trainer or accelerate build it inside
``train()``); given one, :mod:`.deepspeed_engine` reads the engine itself. DeepSpeed skips
``optimizer.step`` itself on overflow, so the watch's optimizer hooks never see a skipped step. What it
does emit, through the ``"DeepSpeed"`` logger, is one line per skip (deepspeed 0.19.8,
``deepspeed/runtime/fp16/loss_scaler.py``; checked against a real fp16 ZeRO run in
tests/test_deepspeed_engine.py):

- ``DynamicLossScaler.update_scale``: ``[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss
  scale: 65536, reducing to 32768`` (or ``..., but hysteresis is 2. Reducing hysteresis to 1``);
  logged at INFO, on rank 0 only (its overflow flag is already all-reduced, so one rank speaks for all).
- ``LossScaler.update_scale`` (static scale): ``[deepspeed] OVERFLOW! Skipping step. Gradients are
  non-finite, weights were not updated.`` at WARNING, through ``log_dist(..., ranks=[0])``.

``DeepSpeedSkips`` is a logging handler on that logger feeding the watch's skip-streak detector;
the steps the watch does see (optimizer steps that ran) end a streak.
"""
from __future__ import annotations

import logging
import re
from typing import Any

from ...findings import Event
from ..detectors.thresholds import SkipStreak

LOGGER = "DeepSpeed"
OVERFLOW = re.compile(
    r"\[deepspeed\] OVERFLOW! (?:Rank (?P<rank>\d+) )?Skipping step\."
    r"(?: Attempted loss scale: (?P<attempted>\d+), (?:reducing to (?P<next>\d+)|but hysteresis is (?P<hysteresis>\d+)))?")


def parse_overflow(message: str) -> dict[str, Any] | None:
    """The numbers in one DeepSpeed overflow line, or None for any other message."""
    found = OVERFLOW.search(message)
    if found is None:
        return None
    out: dict[str, Any] = {"source": "deepspeed"}
    for key, convert in (("rank", int), ("attempted", float), ("next", float), ("hysteresis", int)):
        if found.group(key) is not None:
            out[key] = convert(found.group(key))
    return out


class DeepSpeedSkips(logging.Handler):
    """Counts DeepSpeed's skipped steps for one watch; a streak becomes a ``skipped-steps`` event."""

    def __init__(self, watch: Any):
        super().__init__(level=logging.DEBUG)
        self.watch = watch
        self.streak = SkipStreak(watch.settings)
        self.skips: list[dict[str, Any]] = []
        self._logger = logging.getLogger(LOGGER)
        self._old_level: int | None = None

    def attach(self) -> DeepSpeedSkips:
        self._logger.addHandler(self)
        if self._logger.getEffectiveLevel() > logging.INFO:  # DeepSpeed's dynamic scaler logs at INFO
            self._old_level = self._logger.level
            self._logger.setLevel(logging.INFO)
        self.watch.add_listener(self._on_watch)
        return self

    def detach(self) -> None:
        self._logger.removeHandler(self)
        if self._old_level is not None:
            self._logger.setLevel(self._old_level)
            self._old_level = None
        self.watch.remove_listener(self._on_watch)

    def _on_watch(self, watch: Any, kind: str, payload: Any) -> None:
        if kind == "step" and not payload.get("skipped"):
            self.streak.update(False, None)  # an optimizer step ran: the streak is over

    def emit(self, record: logging.LogRecord) -> None:
        try:
            found = parse_overflow(record.getMessage())
            if found is None:
                return
            self.skips.append(found)
            scale = found.get("next", found.get("attempted"))
            evidence = self.streak.update(True, scale)
            if evidence is not None:
                evidence.update({"source": "deepspeed", "loss_scale": scale, "message": record.getMessage()})
                self.watch.emit(Event("skipped-steps", self.watch.step,
                                       f"DeepSpeed skipped {evidence['consecutive_skipped']} optimizer steps in a row "
                                       f"(loss scale down to {scale})", evidence=evidence))
        except Exception:  # a logging handler must never break the user's run
            self.handleError(record)
