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
from collections.abc import Iterator
from typing import Any

import torch

from ..introspect.modes import modes_restored
from ..step.capture import MicroBatch, model_loss, preserved_rng, restore_rng, supervised_mask
from ..step.eager import eager_everywhere, unwrap_compiled
from ..step.plan import CapturedStep, ShadowPlan
from ..step.precision import autocast_as, autocast_text
from ..step.tensors import float_tensors, iter_tensors
from ..watcher.core.lifecycle import attached_watches
from .result import StepEvidence

MAX_NAMED_GRADS = 5


# ---- leaving no trace -------------------------------------------------------------------------
@contextlib.contextmanager
def quiet_watches(model: torch.nn.Module) -> Iterator[None]:
    """Any attached nbguard watch on ``model`` ignores the shadow runs (as it does its own replay)."""
    eager = unwrap_compiled(model)[0]
    watches = [w for w in attached_watches() if unwrap_compiled(w.model)[0] is eager]
    with contextlib.ExitStack() as stack:
        for w in watches:
            stack.enter_context(w.paused())
        yield


@contextlib.contextmanager
def preserved(model: torch.nn.Module) -> Iterator[None]:
    """Train/eval flags of every module, gradient checkpointing flags and every global RNG: put back afterwards."""
    with preserved_rng(), modes_restored(model):
        yield


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
    """The weight dtypes the step ran with: "trainable 4 float32; frozen 12 bfloat16"."""
    counts: dict[str, dict[str, int]] = {"trainable": {}, "frozen": {}}
    for name, p in model.named_parameters():
        group = counts["trainable" if p.requires_grad else "frozen"]
        dt = str(tensors.get(name, p).dtype).replace("torch.", "")
        group[dt] = group.get(dt, 0) + 1
    parts = [f"{kind} " + ", ".join(f"{n} {d}" for d, n in sorted(dts.items())) for kind, dts in counts.items() if dts]
    return "; ".join(parts) if counts["trainable"] else "; ".join(["no trainable weights", *parts])


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
    supervised: int | None = None
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
                labels = kwargs.get("labels")
                if isinstance(labels, torch.Tensor):
                    supervised = (supervised or 0) + int(supervised_mask(labels).sum())
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
                if loss is None and not all(bool(torch.isfinite(s).all()) for s in seeds):
                    # the loss is computed outside the model, and the gradient it sent back came from the failing
                    # outputs (inf): it says nothing about the outputs under the fix, so no backward is judged
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
    precision = autocast_text(autocast if autocast is not None else
                               (step.micro_batches[0].autocast if step.micro_batches else []))
    return StepEvidence(loss=loss_value, total_grad_norm=total, grads_finite=grads_finite,
                        largest_activation=largest, largest_activation_at=where, first_nonfinite=first_bad,
                        nonfinite_grads=bad_grads[:MAX_NAMED_GRADS],
                        precision=f"{precision}; {_dtype_summary(model, plan.tensors)}",
                        seconds=time.perf_counter() - started, micro_batches=ran, supervised_tokens=supervised)


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
