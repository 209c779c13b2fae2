"""The module-level check: the origin module alone, re-run on its captured inputs.

Cheap (one forward up to the origin, then the origin alone per precision) and it always runs:
it says whether the origin's output fits each precision ("abs-max 8.1e5: overflows fp16, fits
bf16 and fp32") and, per fix, whether the origin's output stays finite under it. It adds the
memory of one module's inputs and output.
"""
from __future__ import annotations

import math
import time
from typing import Any

import torch

from ..step.capture import restore_rng
from ..step.eager import eager_everywhere
from ..step.plan import CapturedStep, ShadowPlan
from ..step.precision import autocast_as
from ..step.tensors import float_tensors
from .result import ModuleCheck, ModuleEvidence
from .shadow import attributes_set, preserved, quiet_watches

RANGES = {"float16": torch.finfo(torch.float16).max, "bfloat16": torch.finfo(torch.bfloat16).max,
          "float32": torch.finfo(torch.float32).max}


class _Captured(Exception):
    """Raised by the pre-hook: the origin's inputs are in hand, the rest of the forward is not needed."""


def _detach(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, tuple):
        return tuple(_detach(v) for v in value)
    if isinstance(value, list):
        return [_detach(v) for v in value]
    if isinstance(value, dict):
        return {k: _detach(v) for k, v in value.items()}
    return value


def capture_inputs(step: CapturedStep) -> tuple[tuple, dict]:
    """The origin module's inputs on the failing micro-batch, as the model computed them."""
    model = step.eager
    module = model.get_submodule(step.origin_module or "")
    mb = next((m for m in step.micro_batches if m.index == step.origin_micro_batch), step.micro_batches[0])
    kept: list[tuple[tuple, dict]] = []

    def grab(mod, args, kwargs):
        kept.append((_detach(args), _detach(kwargs)))
        raise _Captured

    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    handle = module.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with quiet_watches(step.model), preserved(model), eager_everywhere(), torch.no_grad(), \
                autocast_as(mb.autocast):
            step.set_modes()
            restore_rng(mb.rng)
            try:
                torch.func.functional_call(model, buffers, mb.args, mb.kwargs, strict=False)
            except _Captured:
                pass
    finally:
        handle.remove()
    if not kept:
        raise RuntimeError(f"the origin module {step.origin_module!r} did not run on micro-batch {mb.index}")
    return kept[0]


def _cast_inputs(value: Any, dtype: torch.dtype | None) -> Any:
    if dtype is None:
        return value
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, tuple):
        return tuple(_cast_inputs(v, dtype) for v in value)
    if isinstance(value, list):
        return [_cast_inputs(v, dtype) for v in value]
    if isinstance(value, dict):
        return {k: _cast_inputs(v, dtype) for k, v in value.items()}
    return value


def _absmax(output: Any) -> tuple[float, str | None]:
    tensors = [t.detach() for _, t in float_tensors(output)]
    if not tensors:
        return 0.0, None
    value = float(torch.stack([t.float().abs().amax() for t in tensors]).amax())
    return value, str(tensors[0].dtype).replace("torch.", "")


def run_module(step: CapturedStep, inputs: tuple[tuple, dict], plan: ShadowPlan,
               reference: bool = False) -> ModuleEvidence:
    """The origin module on its inputs under ``plan`` (``reference``: everything in float32, no autocast)."""
    name = step.origin_module or ""
    module = step.eager.get_submodule(name)
    prefix = f"{name}." if name else ""
    mb = next((m for m in step.micro_batches if m.index == step.origin_micro_batch), step.micro_batches[0])
    local = {n: t for n, t in plan.tensors.items() if n.startswith(prefix)}
    local = {n[len(prefix):]: t for n, t in local.items()}
    params = dict(module.named_parameters())
    if reference:
        local = {n: p.detach().float() for n, p in params.items() if p.is_floating_point()}
    # upstream activations follow the weights: feed the inputs in the dtype the module's weights now have
    dtypes = [local.get(n, p).dtype for n, p in params.items() if local.get(n, p).is_floating_point()]
    in_dtype = torch.float32 if reference else (dtypes[0] if local and dtypes else None)
    if in_dtype is None and not params and not reference:  # a module without weights (an activation): its input
        # comes from the layers before it, in the one dtype the plan moved every weight to (if there is one)
        moved = {t.dtype for t in plan.tensors.values() if t.is_floating_point()}
        in_dtype = moved.pop() if len(moved) == 1 else None
    args, kwargs = _cast_inputs(inputs[0], in_dtype), _cast_inputs(inputs[1], in_dtype)
    local.update({n: b.detach().clone() for n, b in module.named_buffers()})
    regions = [] if reference else (plan.autocast if plan.autocast is not None else mb.autocast)
    with quiet_watches(step.model), preserved(module), attributes_set(plan.attributes), eager_everywhere(), \
            torch.no_grad(), autocast_as(regions):
        restore_rng(mb.rng)
        output = torch.func.functional_call(module, local, args, kwargs, strict=False)
    value, dtype = _absmax(output)
    return ModuleEvidence(name, dtype, value if math.isfinite(value) else None, math.isfinite(value))


def reference_check(step: CapturedStep, inputs: tuple[tuple, dict]) -> ModuleCheck:
    started = time.perf_counter()
    ref = run_module(step, inputs, ShadowPlan(), reference=True)
    fits = {dt: ref.absmax is not None and ref.absmax <= limit for dt, limit in RANGES.items()}
    return ModuleCheck(step.origin_module or "<model>", step.origin_phase or "forward", ref.absmax, fits,
                       time.perf_counter() - started)
