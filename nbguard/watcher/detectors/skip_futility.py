"""Under policy skip, weights that are already inf/NaN: skipping cannot save the run, and one event says so.

Policy skip drops a bad update so the weights stay as they were. That saves a run only while the
weights are finite: once an update that looked finite (Adam dividing by an eps that rounded to 0 in
float16, a huge learning rate) made a weight inf, every later forward is non-finite and every step is
skipped for ever. On the 2nd, 4th, 8th... skipped step in a row this detector looks at the trainable weights
(host work, on the bad path only, until it has spoken; one skipped step is no streak: a NaN row of an
embedding poisons only the batches that use its token) and says once what can still help: restore a checkpoint (or
``policy="rewind"``), then the fix that keeps it from happening again.
"""
from __future__ import annotations

import weakref
from typing import Any

import torch

from ...document.model import register_event_kind
from ...findings import Event
from ...introspect.optimizers import eps_underflows
from ..core.pipeline import Detector, StepView, WatchedRun

KIND = "skip-cannot-save"
register_event_kind(KIND, "policy skip drops updates, but the weights are already inf/NaN: skipping cannot save "
                          "the run", ("nonfinite_parameters", "skipped_steps", "restore", "fixes"))


def nonfinite_weights(model: torch.nn.Module) -> dict[str, int]:
    """Trainable floating-point parameters holding inf/NaN, with the count of bad values."""
    bad = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad and p.is_floating_point():
                n = int((~torch.isfinite(p)).sum())
                if n:
                    bad[name] = n
    return bad


def preventing_fixes(model: torch.nn.Module, optimizer: Any) -> list[str]:
    """The fixes that keep the weights finite next time, most specific first."""
    if optimizer is not None and eps_underflows(optimizer):
        return ["optimizer-eps-for-dtype", "upcast-trainable-fp32"]
    if any(p.requires_grad and p.dtype in (torch.float16, torch.bfloat16) for p in model.parameters()):
        return ["upcast-trainable-fp32", "lower-learning-rate"]
    return ["lower-learning-rate", "enable-grad-clipping"]


class SkipCannotSave(Detector):
    name = KIND

    def __init__(self) -> None:
        self._watch: Any = None  # a weak reference to the watch, taken at its first read
        self.event: Event | None = None
        self.skipped = 0

    def scalars(self, watch: WatchedRun) -> dict[str, torch.Tensor]:
        if self._watch is None:
            self._watch = weakref.ref(watch)
        return {}

    def update(self, view: StepView) -> list[Event]:
        if self.event is not None:
            return []
        if not view.skipped:
            self.skipped = 0  # a step trained: whatever is inf did not stop it (a NaN row of an embedding
            return []         # poisons only the batches that use that token)
        watch = self._watch() if self._watch is not None else None
        if watch is None or getattr(watch, "policy", None) != "skip":
            return []
        self.skipped += 1
        # only a streak says the run cannot go on: skipped steps 2, 4, 8... in a row (few scans on a long one)
        if self.skipped < 2 or self.skipped & (self.skipped - 1):
            return []
        bad = nonfinite_weights(watch.model)
        if not bad:
            return []
        fixes = preventing_fixes(watch.model, getattr(watch, "optimizer", None))
        names = list(bad)
        restore = ["restore the last checkpoint saved before the weights went bad (the model and the optimizer "
                   "state), or watch with policy='rewind' to restore the last good snapshot automatically",
                   f"then apply {fixes[0]} so the weights stay finite"]
        evidence = {"nonfinite_parameters": {"first": names[:10], "count": len(names),
                                             "values": sum(bad.values())},
                    "skipped_steps": self.skipped, "restore": restore, "fixes": fixes}
        self.event = Event(
            KIND, view.step,
            f"skipping cannot save this run: {self.skipped} steps in a row were skipped and {len(names)} trainable "
            f"weight tensor(s) are already inf/NaN (e.g. {names[0]}), so the forwards that use them stay non-finite. "
            f"Restore a checkpoint from before (or use policy='rewind'), then apply {fixes[0]} to keep the weights "
            "finite",
            evidence=evidence)
        return [self.event]
