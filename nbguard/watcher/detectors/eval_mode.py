"""Optimizer steps on a model left in eval mode: dropout off and batch-norm statistics frozen, in any loop.

``model.eval()`` for a validation pass with no ``model.train()`` after it (or a model straight from
``from_pretrained``, which returns it in eval mode, trained without ever calling ``model.train()``)
trains every later step with no dropout and with batch-norm layers normalising by their running
statistics instead of the batch's, and never updating them. Nothing is NaN; the run just overfits or
drifts. A Trainer calls ``model.train()`` before each training step, so its evaluations never leave it
there; a wrapper whose ``train()`` sets only its own flag does, and its inner dropout layers are the
same failure (the model says training, its dropout layers are in eval).

At each optimizer step's end this detector reads ``module.training`` (a Python attribute: no tensor,
no sync) on the modules where the mode changes what the step computes: dropout with p > 0,
transformers attention with ``attention_dropout > 0``, batch-norm that tracks running statistics. The
list is taken once and refreshed every ``REFRESH`` steps (a few hundred attribute reads per step on a
large model). One event per run, at the first step that ran in eval mode; the steps after it are
counted on the same event. Batch-norm in eval inside a model that trains is left alone: freezing
batch-norm is a common deliberate choice.
"""
from __future__ import annotations

import weakref
from typing import Any

import torch

from ...document.model import register_event_kind
from ...findings import Event
from ...introspect.modes import applies_dropout
from ..core.pipeline import Detector, StepView, WatchedRun

KIND = "trained-in-eval-mode"
register_event_kind(KIND, "optimizer steps ran on dropout or batch-norm modules in eval mode (model.eval() for a "
                          "validation pass with no model.train() after it)",
                    ("first_step", "modules", "count", "model_in_eval", "steps_in_eval", "fixes"))

REFRESH = 200  # optimizer steps between walks of the model's modules (new adapters, swapped heads)
LISTED = 10  # module names kept on the event


def mode_sensitive(module: torch.nn.Module) -> str | None:
    """What eval mode changes in this module's training forward: "dropout", "batch-norm", or None."""
    if applies_dropout(module):
        return "dropout"
    if isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and module.track_running_stats:
        return "batch-norm"  # (without running statistics, eval mode normalises by the batch too)
    return None


class TrainedInEvalMode(Detector):
    name = KIND

    def __init__(self, refresh: int = REFRESH) -> None:
        self.refresh = refresh
        self._watch: Any = None  # a weak reference to the watch, taken at its first read
        self._modules: list[tuple[str, torch.nn.Module, str]] = []  # (name, module, what eval changes)
        self._listed_at: int | None = None  # the step the module list was taken
        self.event: Event | None = None

    def scalars(self, watch: WatchedRun) -> dict[str, torch.Tensor]:
        if self._watch is None:
            self._watch = weakref.ref(watch)
        return {}  # nothing rides along in the read: modes are host attributes

    def _sensitive(self, model: torch.nn.Module, step: int) -> list[tuple[str, torch.nn.Module, str]]:
        if self._listed_at is None or step - self._listed_at >= self.refresh:
            self._modules = [(name, m, what) for name, m in model.named_modules()
                             if (what := mode_sensitive(m)) is not None]
            self._listed_at = step
        return self._modules

    def update(self, view: StepView) -> list[Event]:
        watch = self._watch() if self._watch is not None else None
        model = getattr(watch, "model", None)
        if not isinstance(model, torch.nn.Module):
            return []
        if self.event is not None:
            # counted on the one event: a few attribute reads, until the loop calls model.train() again
            if any(not m.training for _, m, _what in self._modules if self._counts(model, _what)):
                self.event.evidence["steps_in_eval"] += 1
                self.event.evidence["last_step"] = view.step
            return []
        in_eval = not model.training
        if not in_eval and all(m.training for _, m, _what in self._modules) and self._listed_at is not None \
                and view.step - self._listed_at < self.refresh:
            return []  # the usual step: every listed module trains
        off = [(name, what) for name, m, what in self._sensitive(model, view.step)
               if not m.training and self._counts(model, what)]
        if not off:
            return []
        self.event = self._event(view.step, off, in_eval, watch)
        return [self.event]

    @staticmethod
    def _counts(model: torch.nn.Module, what: str) -> bool:
        """A module in eval counts when the whole model is in eval, or when it applies dropout (batch-norm
        kept in eval inside a training model is usually frozen on purpose)."""
        return not model.training or what == "dropout"

    def _event(self, step: int, off: list[tuple[str, str]], in_eval: bool, watch: Any) -> Event:
        counts = {what: sum(1 for _, w in off if w == what) for what in ("dropout", "batch-norm")}
        said = " and ".join(f"{n} {what} module(s)" for what, n in counts.items() if n)
        trainer = getattr(watch, "trainer", None) is not None
        if in_eval:
            why = ("the model was in eval mode: model.eval() for a validation pass (or from_pretrained, which "
                   "returns the model in eval mode) with no model.train() before training went on")
            fixes = ["model-train-mode"]
            how = "call model.train() after every evaluation pass, before the next training step"
        else:
            why = ("the model says training but these layers are in eval mode: a wrapper's train() that sets only "
                   "its own flag did not reach them after an evaluation (or an inner .eval())")
            fixes = ["dropout-train-mode"]
            how = "make the wrapper's train() call super().train(mode), or put those layers back in training mode"
        effects = []
        if counts["dropout"]:
            effects.append("no dropout is applied")
        if counts["batch-norm"]:
            effects.append("batch-norm normalises by frozen running statistics and never updates them")
        names = [name or "(the model)" for name, _ in off]
        return Event(
            KIND, step,
            f"optimizer step {step} trained {said} in eval mode ({', '.join(names[:3])}"
            f"{'...' if len(names) > 3 else ''}): {'; '.join(effects)}. Cause: {why}. Fix: {how}",
            evidence={"first_step": step, "last_step": step, "steps_in_eval": 1, "modules": names[:LISTED],
                      "count": len(off), "dropout": counts["dropout"], "batch_norm": counts["batch-norm"],
                      "model_in_eval": in_eval, "trainer": trainer, "fixes": fixes})
