"""The shadow step: the captured step run again with a fix applied to a shadow of the model.

Like the watch's replay it runs eagerly (functions under ``torch.compile`` too). The user's objects
are never changed. Parameters and buffers the fix would change are passed as new tensors through
``torch.func.functional_call``; every other buffer is passed as a copy (so an in-place update lands on the copy); gradients are taken with ``torch.autograd.grad`` (nothing is
accumulated into ``.grad``); attributes a fix sets (``use_cache``, compute dtypes, gradient
checkpointing) are set for the run and put back; the RNG state and every module's train/eval
flag are restored; and any nbguard watch on the model is told to look away.
"""
from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..watcher.capture import MicroBatch, autocast_as, capture_rng, model_loss, restore_rng
from ..watcher.replay import eager_everywhere, unwrap_compiled
from ..watcher.tensors import float_tensors, iter_tensors
from ..watcher.watch import _ATTACHED
from .result import StepEvidence

MAX_NAMED_GRADS = 5


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
    weights: list[tuple[str, torch.Tensor, int, int, torch.dtype]] = field(default_factory=list)
    modes: list[tuple[torch.nn.Module, bool]] = field(default_factory=list)

    def __post_init__(self) -> None:
        # in-place version counters, storage and dtype: a later optimizer step or fix shows as a change
        self.weights = [(n, p, p._version, p.data_ptr(), p.dtype) for n, p in self.eager.named_parameters()]
        # train/eval flags as the step ran (a module the user keeps in eval keeps its dropout off)
        self.modes = [(m, m.training) for m in self.eager.modules()]

    def set_modes(self) -> None:
        """Every module's train/eval flag as when the step was captured (inside ``preserved``)."""
        for module, training in self.modes:
            module.training = training

    @property
    def eager(self) -> torch.nn.Module:
        return unwrap_compiled(self.model)[0]

    def weights_moved(self) -> list[str]:
        """Parameters changed since the step was captured (the step would no longer be the failing one)."""
        return [n for n, p, version, ptr, dtype in self.weights
                if p._version != version or p.data_ptr() != ptr or p.dtype != dtype]


# ---- leaving no trace -------------------------------------------------------------------------
@contextlib.contextmanager
def quiet_watches(model: torch.nn.Module) -> Iterator[None]:
    """Any attached nbguard watch on ``model`` ignores the shadow runs (as it does its own replay)."""
    eager = unwrap_compiled(model)[0]
    alive = [ref() for ref in list(_ATTACHED.values())]  # the map holds weak references to the watches
    watches = [w for w in alive if w is not None and unwrap_compiled(w.model)[0] is eager]
    with contextlib.ExitStack() as stack:
        for w in watches:
            stack.enter_context(w.paused())
        yield


@contextlib.contextmanager
def preserved(model: torch.nn.Module) -> Iterator[None]:
    """Train/eval flags of every module, gradient checkpointing flags and the RNG: put back afterwards."""
    modes = [(m, m.training) for m in model.modules()]
    rng = capture_rng()
    try:
        yield
    finally:
        for m, mode in modes:
            m.training = mode
        restore_rng(rng)


@contextlib.contextmanager
def attributes_set(attributes: list[tuple[Any, str, Any]]) -> Iterator[None]:
    missing = object()
    saved = [(obj, name, getattr(obj, name, missing)) for obj, name, _ in attributes]
    try:
        for obj, name, value in attributes:
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, old in reversed(saved):
            if old is missing:
                delattr(obj, name)
            else:
                setattr(obj, name, old)


def checkpointing_off(model: torch.nn.Module) -> list[tuple[Any, str, Any]]:
    """Gradient checkpointing recomputes forwards during backward, outside functional_call, with the
    user's weights: the shadow step runs without it (it changes memory, not values)."""
    return [(m, "gradient_checkpointing", False) for m in model.modules()
            if getattr(m, "gradient_checkpointing", False) is True]


# ---- one shadow run -------------------------------------------------------------------------------
class _Activations:
    """Forward hooks: each module's output abs-max and finiteness, kept on the device (one read at the end)."""

    def __init__(self, model: torch.nn.Module):
        self.names = [n for n, _ in model.named_modules()]
        self.records: list[tuple[str, torch.Tensor]] = []
        self.handles = [m.register_forward_hook(self._hook(n)) for n, m in model.named_modules() if n]

    def _hook(self, name: str):
        def hook(module, args, output):
            tensors = [t.detach() for _, t in float_tensors(output)]
            if tensors:
                amax = torch.stack([t.abs().amax().float() for t in tensors]).amax()
                self.records.append((name, amax))
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()

    def read(self) -> tuple[float | None, str | None, str | None]:
        """(largest finite abs-max, where, first module whose output was non-finite)."""
        if not self.records:
            return None, None, None
        values = torch.stack([v.to(self.records[0][1].device) for _, v in self.records]).tolist()  # one read
        first_bad = next((self.records[i][0] for i, v in enumerate(values) if not math.isfinite(v)), None)
        finite = [(v, self.records[i][0]) for i, v in enumerate(values) if math.isfinite(v)]
        if not finite:
            return None, None, first_bad
        best = max(finite, key=lambda e: e[0])
        return best[0], best[1], first_bad


def _dtype_summary(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> str:
    counts: dict[str, int] = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            dt = str(tensors.get(name, p).dtype).replace("torch.", "")
            counts[dt] = counts.get(dt, 0) + 1
    return "trainable " + ", ".join(f"{n} {d}" for d, n in sorted(counts.items())) if counts else "no trainable weights"


def _autocast_text(regions: list[tuple[str, torch.dtype]]) -> str:
    if not regions:
        return "no autocast"
    return ", ".join(f"autocast {d} {str(t).replace('torch.', '')}" for d, t in regions)


def run_step(step: CapturedStep, plan: ShadowPlan) -> StepEvidence:
    """The captured step under ``plan``: forward and backward of every micro-batch on the shadow."""
    model = step.eager
    started = time.perf_counter()
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    # every buffer as a copy: the shadow's in-place updates (running stats, caches) stay in the shadow
    substitutes = {n: b.detach().clone() for n, b in model.named_buffers()}
    substitutes.update(plan.tensors)
    inputs = []
    for name, p in trainable:
        t = plan.tensors.get(name)
        if t is not None:
            t = t.detach().requires_grad_(True)
            substitutes[name] = t
        inputs.append(t if t is not None else p)
    autocast = plan.autocast
    losses: list[float] = []
    grads: list[torch.Tensor | None] = [None] * len(inputs)
    activations = _Activations(model)
    first_bad: str | None = None
    ran = 0
    try:
        with quiet_watches(step.model), preserved(model), eager_everywhere(), \
                attributes_set(checkpointing_off(model) + plan.attributes):
            step.set_modes()
            for mb in step.micro_batches:
                corrected = plan.batch(mb.args, mb.kwargs) if plan.batch is not None else (mb.args, mb.kwargs)
                if corrected is None:  # the data fix drops this whole micro-batch
                    continue
                args, kwargs = corrected
                ran += 1
                restore_rng(mb.rng)
                with torch.enable_grad(), autocast_as(autocast if autocast is not None else mb.autocast):
                    output = torch.func.functional_call(model, substitutes, args, kwargs, tie_weights=True,
                                                        strict=False)
                targets, seeds = _backward_seeds(output, mb)
                loss = model_loss(output)
                if loss is not None:
                    losses.append(float(loss.detach().float()))
                if not targets or not inputs:
                    continue
                got = torch.autograd.grad(targets, inputs, seeds, allow_unused=True)
                for i, g in enumerate(got):
                    if g is not None:
                        previous = grads[i]
                        grads[i] = g if previous is None else previous + g
                del output, targets, got
    finally:
        activations.remove()
    largest, where, bad_module = activations.read()
    if bad_module is not None:
        first_bad = f"forward: {bad_module}"
    present = [(n, g) for (n, _), g in zip(trainable, grads) if g is not None]
    total, grads_finite, bad_grads = None, None, []
    if present:
        if plan.clip_grad_norm is not None:
            norm = torch.nn.utils.get_total_norm([g for _, g in present])
            torch.nn.utils.clip_grads_with_norm_([g for _, g in present], plan.clip_grad_norm, norm)
        norms = torch.stack([torch.linalg.vector_norm(g.float()) for _, g in present])
        host = norms.tolist()  # one read for every gradient's norm
        total = float(torch.linalg.vector_norm(norms))
        bad_grads = [n for (n, _), v in zip(present, host) if not math.isfinite(v)]
        grads_finite = not bad_grads
        if bad_grads and first_bad is None:
            first_bad = f"gradient: {bad_grads[0]}"
    loss_value = None
    if losses:
        loss_value = sum(losses) / len(losses) if all(math.isfinite(x) for x in losses) else \
            next(x for x in losses if not math.isfinite(x))
    precision = _autocast_text(autocast if autocast is not None else
                               (step.micro_batches[0].autocast if step.micro_batches else []))
    return StepEvidence(loss=loss_value, total_grad_norm=total, grads_finite=grads_finite,
                        largest_activation=largest, largest_activation_at=where, first_nonfinite=first_bad,
                        nonfinite_grads=bad_grads[:MAX_NAMED_GRADS],
                        precision=f"{precision}; {_dtype_summary(model, plan.tensors)}",
                        seconds=time.perf_counter() - started, micro_batches=ran)


def _backward_seeds(output: Any, mb: MicroBatch) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Where the backward starts: the gradients the real backward left at the outputs (loss scaling
    and accumulation included), or 1 for the model's own loss when none were captured or they no
    longer fit (a data fix changed the batch's shape)."""
    targets, seeds = [], []
    for path, t in iter_tensors(output):
        g = mb.output_grads.get(path)
        if g is not None and t.requires_grad and g.shape == t.shape:
            targets.append(t)
            seeds.append(g.to(t.dtype))
    if targets:
        return targets, seeds
    loss = model_loss(output)
    if loss is not None and loss.requires_grad:
        return [loss], [torch.ones_like(loss)]
    return [], []
