"""The ``nbguard/…`` scalars of one step, from the payload the watch hands its listeners (values the
step's single read already brought to the host: nothing here touches a device tensor)."""
from __future__ import annotations

from collections import Counter
from typing import Any

from ..watcher.reads.activations import FP16_LIMIT
from .names import fold, short_names

PREFIX = "nbguard/"


class StepScalars:
    """Turns step payloads and events into flat ``{name: float}`` dicts with fixed names."""

    def __init__(self, max_series: int = 16):
        if not isinstance(max_series, int) or max_series < 2:
            raise ValueError(f"max_series must be an int of at least 2, got {max_series!r}")
        self.max_series = max_series
        self.skipped = 0
        self.events: Counter[str] = Counter()
        self._names: dict[str, str] = {}

    def count_step(self, payload: dict[str, Any]) -> None:
        self.skipped += bool(payload.get("skipped"))

    def count_event(self, kind: str) -> None:
        self.events[kind] += 1

    def _short(self, groups: dict[str, Any]) -> dict[str, Any]:
        if set(groups) - set(self._names):
            self._names = short_names(list(groups))
        return {self._names[g]: v for g, v in groups.items()}

    def of(self, payload: dict[str, Any]) -> dict[str, float]:
        out: dict[str, float] = {}
        for key in ("loss", "total_grad_norm", "loss_scale", "total_update_norm"):
            if payload.get(key) is not None:
                out[PREFIX + key] = float(payload[key])
        for group, norm in fold(self._short(payload.get("grad_norm", {})), self.max_series).items():
            out[f"{PREFIX}grad_norm/{group}"] = norm
        # ||Δw|| / ||w|| per group: the update the step's read brought (the step before's; under a
        # GradScaler the step's own), logged at this step (a tracker's steps only move forward)
        updates = fold(self._short(payload.get("update_norm", {})), self.max_series, ratios=True)
        for group, ratio in updates.items():
            out[f"{PREFIX}update_norm/{group}"] = ratio
        absmax = [v for v in payload.get("activation_absmax", {}).values() if v is not None]
        if absmax:  # how far the largest activation is from fp16's limit (1.0 = at the limit)
            out[PREFIX + "activation_headroom"] = FP16_LIMIT / max(max(absmax), 1e-30)
        out[PREFIX + "skipped_steps"] = float(self.skipped)
        out.update(self.event_counts())
        return out

    def event_counts(self) -> dict[str, float]:
        counts = {f"{PREFIX}events/{kind}": float(n) for kind, n in sorted(self.events.items())}
        counts[PREFIX + "events"] = float(sum(self.events.values()))
        return counts
