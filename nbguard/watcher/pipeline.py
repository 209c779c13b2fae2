"""The detector pipeline: what a detector is, and the read-only view of a step it is given.

A detector is one class: it may ask for device scalars that ride along in the step's single host
read (``scalars``), judges the step at its end (``update``) and the trainer's logged metrics after
it (``on_log``: TRL's ``reward``, ``rewards/chosen``, ``eval_loss``...). It returns events whose
kinds are registered once with :func:`nbguard.document.register_event_kind`. The watch never
needs to know a detector's name: ``nbguard.watch(..., detectors=[...])`` or
``watch.add_detector(d)`` is the whole registration. See docs/guides/detectors.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..findings import Event

if TYPE_CHECKING:
    from ..step.capture import MicroBatch
    from .history import GradHistory


class WatchedRun(Protocol):
    """What a detector may read from the watch when it asks for scalars (a NanWatch is one)."""

    step: int
    model: torch.nn.Module

    def weight_fingerprint(self) -> torch.Tensor: ...


@dataclass(frozen=True)
class StepView:
    """One optimizer step as the detectors see it, after its one host read. Read-only."""

    step: int  # the watch's optimizer step (0-based, skipped steps counted)
    groups: tuple[str, ...]  # the parameter groups, in the order of ``grad_norm``
    grad_norm: tuple[float, ...]  # per group, pre-clip, unscaled, accumulated over micro-batches
    loss: float | None
    loss_scale: float | None
    skipped: bool  # the update was dropped (policy) or skipped (GradScaler)
    scalars: dict[str, list[float]] = field(default_factory=dict)  # what this detector asked for, by name
    history: GradHistory | None = None  # every earlier step (per-group norms, losses, scales, skips)

    @property
    def total_grad_norm(self) -> float:
        return math.sqrt(sum(v * v for v in self.grad_norm))

    @property
    def finite(self) -> bool:
        return all(math.isfinite(v) for v in self.grad_norm) and (self.loss is None or math.isfinite(self.loss))


class Detector:
    """Base of every detector (subclass it and override what you need; every method is optional).

    Methods run inside the user's training step: keep them host-side and cheap. An exception in
    one is caught: it is recorded as a ``watch-error`` event and the watch steps aside.
    """

    name = "detector"

    def scalars(self, watch: WatchedRun) -> dict[str, torch.Tensor]:
        """Device tensors to fold into this step's single host read, by name (any shape, flattened).
        Their values come back in ``StepView.scalars[name]`` as a list of floats."""
        return {}

    def on_micro_batch(self, micro_batch: MicroBatch) -> None:
        """A training forward was captured (``micro_batch.index``, ``.labels()``, ``.kwargs``)."""

    def update(self, view: StepView) -> list[Event]:
        """The step ended: the events it shows (often none)."""
        return []

    def on_log(self, step: int, logs: dict[str, Any]) -> list[Event]:
        """The trainer logged metrics (``Trainer.log``: loss, learning rate, TRL's rewards, eval_loss)."""
        return []

    def reset_step(self) -> None:
        """A step (or ``train()``) starts, or an interrupted one is abandoned: forget per-step state."""


def check_detector(detector: Any) -> Detector:
    """A clear error for anything that is not a detector, before it is wired into a watch."""
    if isinstance(detector, type):
        raise TypeError(f"pass a detector instance, not the class {detector.__name__}: {detector.__name__}()")
    missing = [m for m in ("scalars", "update", "on_log", "reset_step") if not callable(getattr(detector, m, None))]
    if missing:
        raise TypeError(f"{type(detector).__name__} is not a detector: it lacks {', '.join(missing)}; subclass "
                        f"nbguard.watcher.Detector and override update(view) and/or on_log(step, logs)")
    return detector


class DetectorBoard:
    """The watch's list of detectors: collects their scalars for the read, hands out the values."""

    def __init__(self, detectors: list[Detector]):
        self.detectors = [check_detector(d) for d in detectors]
        self._asked: list[tuple[int, str, int]] = []  # (detector index, name, numel) in read order

    def add(self, detector: Detector) -> None:
        self.detectors.append(check_detector(detector))

    def collect(self, watch: WatchedRun) -> list[torch.Tensor]:
        """Every detector's scalars, flattened, in a stable order (the sentinel stacks them)."""
        self._asked, tensors = [], []
        for i, detector in enumerate(self.detectors):
            for name, tensor in detector.scalars(watch).items():
                flat = tensor.detach() if tensor.requires_grad else tensor  # each no-op call costs on a short step
                if flat.dtype != torch.float32:
                    flat = flat.float()
                if flat.dim() != 1:
                    flat = flat.reshape(-1)
                self._asked.append((i, name, flat.numel()))
                tensors.append(flat)
        return tensors

    def split(self, values: list[float] | None) -> list[dict[str, list[float]]]:
        """The read's values back per detector, by name."""
        out: list[dict[str, list[float]]] = [{} for _ in self.detectors]
        at = 0
        for i, name, n in self._asked:
            out[i][name] = list(values[at:at + n]) if values is not None else []
            at += n
        self._asked = []
        return out

    def reset_step(self) -> None:
        self._asked = []
        for detector in self.detectors:
            detector.reset_step()
