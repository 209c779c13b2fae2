"""Host-side detectors over the numbers the sentinel already read (no device work)."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field


@dataclass
class WatchSettings:
    """Thresholds; a few GradScaler skips on fresh fp16 training are normal, a streak is not."""

    skip_streak: int = 8  # consecutive skipped steps that make an event
    min_loss_scale: float = 1.0  # a scale halved below this has collapsed
    frozen_check_every: int = 10  # optimizer steps between weight fingerprints
    frozen_after: int = 20  # unchanged over this many optimizer steps is an event
    frozen_eval_repeats: int = 1  # bit-identical eval losses in a row (beyond the first): an event
    history_capacity: int = 2048
    max_replays: int = 3
    # per-group ||Δw|| / ||w|| of each update (update_norms.py): a copy of the trainable weights before
    # each step, left out (the history says why) where what its path holds takes more than this many MiB:
    # two flat copies where many small tensors are gathered (a LoRA r=16 on every linear of a 7B, 40M fp32
    # weights: 320 MiB), one where large ones are compared tensor by tensor, one sample's rows on a CPU above
    # update_norms.SAMPLE_ABOVE. The one default: update_norms.make_update_norms reads it from here
    update_norms: bool = True
    update_norm_budget_mb: float = 512.0
    # "host": the step's numbers are read before the optimizer moves (one host wait per step); "deferred":
    # the verdict stays on the device, the numbers are read a step late (reads/deferred.py). The environment's
    # NBGUARD_READ sets it for watches a framework creates (and runs the suite in either mode)
    read: str = field(default_factory=lambda: os.environ.get("NBGUARD_READ", "host"))

    def __post_init__(self) -> None:
        if self.read not in ("host", "deferred"):
            raise ValueError(f"WatchSettings(read={self.read!r}): use 'host' (the default: the step is judged before "
                             f"the update) or 'deferred' (no host wait; judged a step late)")


class SkipStreak:
    def __init__(self, settings: WatchSettings):
        self.settings = settings
        self.streak = 0
        self.total = 0
        self.scales: list[float] = []
        self.reported = False
        self.start: int | None = None  # the optimizer step that opened the current streak
        self._updates = 0

    def update(self, skipped: bool, scale: float | None, step: int | None = None) -> dict | None:
        """Evidence for an event when the streak (or a collapsing scale) crosses the line.

        ``step``: the watch's optimizer step (default: the number of updates so far).
        """
        step = self._updates if step is None else step
        self._updates += 1
        if not skipped:
            self.streak, self.scales, self.reported, self.start = 0, [], False, None
            return None
        if self.streak == 0:
            self.start = step
        self.streak += 1
        self.total += 1
        if scale is not None:
            self.scales.append(scale)
        collapsed = scale is not None and scale < self.settings.min_loss_scale
        if self.reported or not (self.streak >= self.settings.skip_streak or collapsed):
            return None
        self.reported = True
        return {"consecutive_skipped": self.streak, "skipped_total": self.total, "streak_start": self.start,
                "scale_trend": list(self.scales[-12:]), "scale_collapsed": collapsed}


class FrozenDetector:
    """Weights whose per-group fingerprint stays bit-identical across checks are not training."""

    def __init__(self, settings: WatchSettings):
        self.settings = settings
        self.last: list[float] | None = None
        self.since = 0  # the step the current fingerprint was first seen (meaningful once last is set)
        self.reported = False

    def due(self, step: int) -> bool:
        return step % self.settings.frozen_check_every == 0

    def update(self, step: int, fingerprint: list[float]) -> dict | None:
        # an inf fingerprint (weights past fp32's norm range) equals the next one while the weights move
        if self.last is None or fingerprint != self.last or not all(map(math.isfinite, fingerprint)):
            self.last, self.since, self.reported = fingerprint, step, False
            return None
        if self.reported or step - self.since < self.settings.frozen_after:
            return None
        self.reported = True
        return {"unchanged_since_step": self.since, "checked_at_step": step, "steps_unchanged": step - self.since}


class EvalLossDetector:
    def __init__(self, settings: WatchSettings):
        self.settings = settings
        self.values: list[float] = []
        self.reported = False

    def update(self, eval_loss: float) -> dict | None:
        if self.values and eval_loss != self.values[-1]:
            self.values, self.reported = [], False
        self.values.append(eval_loss)
        if self.reported or len(self.values) < self.settings.frozen_eval_repeats + 1:
            return None
        self.reported = True
        return {"eval_loss": eval_loss, "evaluations": len(self.values)}
