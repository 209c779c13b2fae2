"""A fix as it changes one captured step: the step, the plan a fix's recipe makes for it, and why not.

A fix's recipe (``Fix.plan``) receives the captured step and the fix's options and returns a
``ShadowPlan`` (new tensors, autocast, attributes, a batch correction, a gradient clip), never
changing the model, or raises ``NotCheckable(reason)`` when the fix cannot be judged on one step.
The verifier runs the plan on a shadow of the model.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..introspect.modes import ModuleModes, apply_modes, module_modes
from .capture import MicroBatch
from .eager import unwrap_compiled


class NotCheckable(Exception):
    """The fix cannot be judged on the failing step; the message says why."""


@dataclass
class ShadowPlan:
    """How a fix changes the step, without touching the model: what a recipe returns.

    ``tensors``: parameter/buffer name -> the tensor the fix would leave there (new tensors only).
    ``autocast``: the autocast regions to run under instead of the captured ones (None: as captured).
    ``attributes``: (object, attribute, value) set for the run and restored afterwards.
    ``batch``: turns a micro-batch's (args, kwargs) into the corrected ones (data fixes).
    ``clip_grad_norm``: the gradients are clipped to this total norm before they are judged.
    ``changes``: a short description of each change, for the evidence.
    """

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    autocast: list[tuple[str, torch.dtype]] | None = None
    attributes: list[tuple[Any, str, Any]] = field(default_factory=list)
    batch: Callable[[tuple, dict], tuple[tuple, dict] | None] | None = None  # None: drop the micro-batch
    clip_grad_norm: float | None = None
    changes: dict[str, Any] = field(default_factory=dict)
    note: str = ""

    @property
    def empty(self) -> bool:
        """The fix would change nothing this step computes."""
        return not (self.tensors or self.autocast is not None or self.attributes or self.batch is not None
                    or self.clip_grad_norm is not None)

    def key(self) -> tuple:
        """Plans with the same key compute the same step (used to run such a step once)."""
        return (tuple(sorted((n, id(t)) for n, t in self.tensors.items())), repr(self.autocast),
                tuple((id(o), a, repr(v)) for o, a, v in self.attributes), id(self.batch), self.clip_grad_norm)


@dataclass
class CapturedStep:
    """The failing step as the watch captured it (or a batch the audit was given)."""

    model: torch.nn.Module
    micro_batches: list[MicroBatch]
    origin_module: str | None = None  # eager module name (no torch.compile prefix)
    origin_phase: str | None = None
    origin_micro_batch: int = 0
    reproduced: bool = True  # the replay saw the failure (False: it stayed finite in eager)
    args: Any = None  # the TrainingArguments the step ran under (None: a plain loop, its autocast its own)
    weights: list[tuple[str, torch.Tensor, int, int, torch.dtype]] = field(default_factory=list)
    modes: ModuleModes = field(default_factory=list)

    def __post_init__(self) -> None:
        # in-place version counters, storage and dtype: a later optimizer step or fix shows as a change
        self.weights = [(n, p, p._version, p.data_ptr(), p.dtype) for n, p in self.eager.named_parameters()]
        # train/eval flags as the step ran (a module the user keeps in eval keeps its dropout off)
        self.modes = module_modes(self.eager)

    def set_modes(self) -> None:
        """Every module's train/eval flag as when the step was captured (inside ``preserved``)."""
        apply_modes(self.modes)

    @property
    def eager(self) -> torch.nn.Module:
        return unwrap_compiled(self.model)[0]

    def weights_moved(self) -> list[str]:
        """Parameters changed since the step was captured (the step would no longer be the failing one)."""
        return [n for n, p, version, ptr, dtype in self.weights
                if p._version != version or p.data_ptr() != ptr or p.dtype != dtype]
