"""DeepSpeed's skipped steps and gradient norm, read from the engine itself after each ``engine.step()``.

Under ZeRO the engine decides on its own whether an optimizer step runs: its optimizer all-reduces an
overflow flag and, when any rank's gradients are non-finite, skips the inner ``optimizer.step``
(fp16: the loss scaler's overflow; bf16 and fp32 ZeRO: ``check_grad_overflow``). The watch's
optimizer hooks then never see that step. So this reader patches the engine's ``backward`` (this
rank's own loss) and ``step`` (``integrations/instance_wrap.py``) and, at each optimizer step
boundary (``engine.global_steps`` moved), reads what the engine really did (deepspeed 0.19.8):

- ``engine.skipped_steps``: grows by one for a step the engine skipped (``optimizer.overflow``);
- ``engine.get_global_grad_norm()``: the unscaled global gradient norm (``inf`` on overflow,
  ``None`` where ZeRO 1/2 norm computation is off);
- ``engine.optimizer.cur_scale``: the fp16 loss scale.

fp16 (a loss scaler): a single skip is the scaler calibrating, so only a streak of skips (or a scale
collapse) is an event, as for a GradScaler. Without loss scaling (bf16, fp32) a skipped step is a
genuinely non-finite gradient: an event at once. The overflow flag is the same on every rank (the
engine all-reduced it), so every rank reports the same step, with no collective of the watch's own;
each rank adds whether its own loss was non-finite (the rank whose loss was names itself).

Where no engine is at hand (a Trainer or accelerate that builds the engine inside ``train()``), the
watch falls back to DeepSpeed's log lines (:mod:`.deepspeed_skips`).
"""
from __future__ import annotations

import functools
import math
from collections import deque
from typing import Any

import torch

from ...findings import Event
from ..detectors.thresholds import SkipStreak
from ..integrations.instance_wrap import Patch, patch

KEPT_STEPS = 1000  # the engine's per-step readings kept (a long run must not grow them without bound)


def find_engine(target: Any) -> Any:
    """``target`` if it is a DeepSpeed engine (by class name: deepspeed need not be importable here)."""
    is_engine = any(cls.__name__ == "DeepSpeedEngine" for cls in type(target).__mro__)
    return target if is_engine else None


def _number(value: Any) -> float | None:
    """A float from the engine's tensor or float, None where it has none."""
    if value is None:
        return None
    return float(value.item() if isinstance(value, torch.Tensor) else value)


class DeepSpeedEngineReader:
    """Reads one DeepSpeed engine for one watch; its readings are in ``steps`` (newest last)."""

    def __init__(self, watch: Any, engine: Any):
        self.watch = watch  # the watch's context.WatchContext (not imported: context -> distributed -> here)
        self.engine = engine
        self.streak = SkipStreak(watch.settings)
        self.steps: deque[dict[str, Any]] = deque(maxlen=KEPT_STEPS)
        self._skipped_before = int(engine.skipped_steps)
        self._global_before = int(engine.global_steps)
        self._losses: list[torch.Tensor] = []  # this rank's losses since the last boundary (detached)
        self._patches: list[Patch] = []

    # ---- patching the engine's own methods (instance attributes, removed on detach) -----------------
    def attach(self) -> DeepSpeedEngineReader:
        # a reading that fails records a watch-error and steps the watch aside; the engine's call still runs
        on_error = functools.partial(self.watch.fail, safe=True)
        self._patches = [patch(self.engine, "backward", self._around_backward, on_error),
                         patch(self.engine, "step", self._around_step, on_error)]
        return self

    def detach(self) -> None:
        for held in self._patches:
            held.remove()
        self._patches = []

    def _around_backward(self, call: Any, *args: Any, **kwargs: Any) -> Any:
        if self.watch.active:
            self._before_backward(*args)
        return call(*args, **kwargs)

    def _around_step(self, call: Any, *args: Any, **kwargs: Any) -> Any:
        result = call(*args, **kwargs)
        if self.watch.active:
            self._after_step()  # the stop policy's NonFiniteError passes through, on purpose
        return result

    # ---- the readings ---------------------------------------------------------------------------------
    def readings(self) -> list[dict[str, Any]]:
        """Every kept reading with its grad norm as a number (read now, off the training step's path)."""
        return [dict(r, grad_norm=_number(r["grad_norm"])) for r in self.steps]

    def _before_backward(self, loss: Any = None, *_: Any) -> None:
        if isinstance(loss, torch.Tensor):
            self._losses.append(loss.detach())  # read only on a bad step (no device sync on a healthy one)

    def _after_step(self) -> None:
        engine = self.engine
        if int(engine.global_steps) == self._global_before:
            return  # a micro-step inside gradient accumulation: no optimizer step yet
        self._global_before = int(engine.global_steps)
        skipped = int(engine.skipped_steps) > self._skipped_before
        self._skipped_before = int(engine.skipped_steps)
        norm = engine.get_global_grad_norm()
        # A norm on the device is read only for a skipped step: reading it on every step would wait for the
        # optimizer's kernels (a second host sync per step). An applied step's non-finite gradient is the
        # watch's own read's to catch (the inner optimizer step ran, so its hooks did too).
        reading = {"global_step": int(engine.global_steps), "skipped": skipped,
                   "skipped_steps": int(engine.skipped_steps),
                   "grad_norm": norm if isinstance(norm, torch.Tensor) and not skipped else _number(norm),
                   "loss_scale": _number(getattr(engine.optimizer, "cur_scale", None)) if engine.fp16_enabled() else None}
        losses, self._losses = self._losses, []
        norm_bad = isinstance(reading["grad_norm"], float) and not math.isfinite(reading["grad_norm"])
        if skipped or norm_bad:
            reading["own_loss_finite"] = all(bool(torch.isfinite(x).all()) for x in losses)
        self.steps.append(reading)
        if engine.fp16_enabled():
            self._loss_scaled(reading)
        elif skipped or norm_bad:
            self._non_finite(reading)

    def _loss_scaled(self, reading: dict[str, Any]) -> None:
        """fp16: a streak of skips (or the scale collapsing) is an event, as for a GradScaler."""
        evidence = self.streak.update(reading["skipped"], reading["loss_scale"])
        if evidence is None:
            return
        evidence.update({"source": "deepspeed-engine", **reading})
        self.watch.emit(Event("skipped-steps", self.watch.step,
                              f"DeepSpeed skipped {evidence['consecutive_skipped']} optimizer steps in a row "
                              f"(loss scale down to {reading['loss_scale']})", evidence=evidence))

    def _non_finite(self, reading: dict[str, Any]) -> None:
        """No loss scaling: the engine saw non-finite gradients (and skipped, unless told not to check)."""
        own_loss_bad = not reading["own_loss_finite"]
        done = "skipped optimizer step" if reading["skipped"] else "APPLIED optimizer step"
        whose = ("this rank's own loss was non-finite" if own_loss_bad
                 else "this rank's loss was finite: another rank's loss or a gradient was not")
        event = Event("nonfinite-loss" if own_loss_bad else "nonfinite-grad", self.watch.step,
                      f"DeepSpeed {done} {reading['global_step']}: the global gradient norm was "
                      f"{reading['grad_norm']} ({whose})",
                      evidence={"source": "deepspeed-engine", **reading})
        ranks = self.watch.ranks
        event.rank = ranks.rank if own_loss_bad and ranks is not None else None
        self.watch.emit(event, agreed=True)  # every rank reports the same step; rank only where it is its own
        if self.watch.policy == "stop":
            self.watch.request_stop(event, step_ended=True)  # every rank saw the same skip: all stop together
