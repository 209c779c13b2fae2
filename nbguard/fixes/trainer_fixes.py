"""Fixes that change the training arguments, and what a Trainer already built from them."""
from __future__ import annotations

import math
import os
from typing import Any

import torch

from ..hardware import resolve_hardware
from ..introspect.dtypes import HALF_DTYPES, dtype_name, quantized_or_integer
from ..introspect.quantization import four_bit_layers, set_compute_dtype
from ..introspect.unsloth import read_unsloth
from ..step.batch import model_device
from ..step.plan import CapturedStep, NotCheckable, ShadowPlan
from ..step.precision import PrecisionUnavailable, args_mixed_precision, autocast_text, trainer_autocast
from ..watcher.reads.clip_tap import clip_limit
from .loop_cells import (
    follow_weight_dtypes,
    input_cast_batch,
    loop_clip,
    loop_clip_code,
    loop_inputs_apply,
    loop_lower_lr,
    loop_lower_lr_code,
    loop_precision_code,
    scale_lr,
    source,
)
from .partial_fp32 import apply_partial_fp32, partial_fp32_code
from .registry import Fix, register


# ---- enable-grad-clipping --------------------------------------------------------------------
def _clip(target, max_norm: float = 1.0, **_):
    if target.args is None:  # a plain loop: its optimizer clips before every step
        return loop_clip(target.optimizer, max_norm)
    old = getattr(target.args, "max_grad_norm", None)
    if old == max_norm:
        return {}
    target.args.max_grad_norm = max_norm
    return {"args.max_grad_norm": f"{old} -> {max_norm}"}


def _clip_code(names, max_norm: float = 1.0, **_):
    if names.args is None:
        return loop_clip_code(names, max_norm)
    # The Trainer reads args.max_grad_norm at every step, so changing it on a built Trainer is enough.
    return f"""# Clip the total gradient norm: one outlier gradient can no longer blow the weights up.
{names.args}.max_grad_norm = {max_norm!r}
"""


def _clip_plan(step: CapturedStep, max_norm: float = 1.0, **_: Any) -> ShadowPlan:
    return ShadowPlan(clip_grad_norm=float(max_norm), changes={"max_grad_norm": max_norm},
                      note="clipping scales this step's gradients; it cannot make a non-finite one finite")


def _clip_holds(step: CapturedStep, max_norm: float = 1.0, **_: Any) -> str | None:
    """The run clips already: the Trainer's args at max_norm or below, or a watched loop's own clip_grad_norm_."""
    if step.args is not None:
        old = getattr(step.args, "max_grad_norm", None)
        return f"args.max_grad_norm is {old!r} already" if old and 0 < old <= max_norm else None
    limit = clip_limit(step.eager.parameters())
    return (f"the loop already calls clip_grad_norm_ with max_norm={limit!r}"
            if limit is not None and limit <= max_norm else None)


register(Fix("enable-grad-clipping", "Clip gradients to norm 1.0",
             "Set args.max_grad_norm = 1.0 (a plain loop: clip before every optimizer.step()).",
             _clip, _clip_code, needs="args-or-optimizer", plan=_clip_plan,
             treats=("overflow", "invalid-op", "nonfinite-parameter"), rank=40, holds=_clip_holds))


# ---- lower-learning-rate ---------------------------------------------------------------------
_BASE_LR = "_nbguard_base_learning_rate"  # the LR before the first lowering: keeps apply idempotent


def _lower_lr(target, factor: float = 0.1, **_):
    if not (isinstance(factor, (int, float)) and 0 < factor < 1):
        raise ValueError(f"factor must be a number between 0 and 1; got {factor!r}")
    if target.args is None:  # a plain loop: its optimizer's groups
        return loop_lower_lr(target.optimizer, factor)
    args = target.args
    base = getattr(args, _BASE_LR, None) or args.learning_rate
    wanted = base * factor
    if math.isclose(args.learning_rate, wanted, rel_tol=1e-9):
        return {}
    scale = wanted / args.learning_rate
    changed: dict[str, Any] = {"args.learning_rate": f"{args.learning_rate:g} -> {wanted:g}"}
    object.__setattr__(args, _BASE_LR, base)
    args.learning_rate = wanted
    trainer = target.trainer
    opt = getattr(trainer, "optimizer", None)
    if opt is not None:  # already built from the old value
        for group in opt.param_groups:
            scale_lr(group, scale)
        changed["optimizer.param_groups"] = len(opt.param_groups)
    sched = getattr(trainer, "lr_scheduler", None)
    if sched is not None and hasattr(sched, "base_lrs"):
        sched.base_lrs = [lr * scale for lr in sched.base_lrs]
        changed["lr_scheduler.base_lrs"] = len(sched.base_lrs)
    return changed


def _lower_lr_code(names, factor: float = 0.1, **_):
    if names.args is None:
        return loop_lower_lr_code(names, factor)
    a = names.args
    code = f"""# A smaller learning rate: the updates that overflowed (or diverged) shrink by {factor!r}x.
_factor = {factor!r}
{a}.learning_rate = {a}.learning_rate * _factor
"""
    if names.trainer:
        t = names.trainer
        code += f"""# The trainer may already have built its optimizer and scheduler from the old value.
{source(scale_lr)}

if {t}.optimizer is not None:
    for _group in {t}.optimizer.param_groups:
        scale_lr(_group, _factor)
if {t}.lr_scheduler is not None:
    {t}.lr_scheduler.base_lrs = [_lr * _factor for _lr in {t}.lr_scheduler.base_lrs]
"""
    return code


def _lower_lr_plan(step: CapturedStep, **_: Any) -> ShadowPlan:
    raise NotCheckable("the learning rate does not enter the failing step's forward or backward; it changes only "
                       "the updates after it")


register(Fix("lower-learning-rate", "Lower the learning rate",
             "Multiply the learning rate by factor (default 0.1), in the args and any optimizer already built.",
             _lower_lr, _lower_lr_code, needs="args-or-optimizer", plan=_lower_lr_plan,
             treats=("overflow", "invalid-op", "nonfinite-parameter"), rank=50))


# ---- switch-precision ------------------------------------------------------------------------
def switch_target(hardware: Any = None, fp16_in_use: bool = True) -> str:
    """Where switch-precision moves a run, the one place it is chosen: an fp16 run to the hardware's best
    half precision (bf16 where native, else fp32); any other run to fp32 (bf16 has fp32's range already:
    only fp32's precision is left to try)."""
    return resolve_hardware(hardware).best_half_precision if fp16_in_use else "fp32"


def _resolve_to(to, hardware=None) -> str:
    if to is None:
        return switch_target(hardware)
    if to not in ("bf16", "fp32"):
        raise ValueError(f"to must be 'bf16', 'fp32' or None (the best for the hardware); got {to!r}")
    return to


def weight_target(p, to):
    """fp32: every half-precision weight to float32. bf16: fp16 weights to bf16, trainable ones to fp32."""
    if to == "fp32":
        return torch.float32 if p.dtype in HALF_DTYPES else None
    if p.dtype == torch.float16:
        return torch.float32 if p.requires_grad else torch.bfloat16
    return None


def _switch_args(args, to, changed):
    flags = {"fp16": False, "bf16": to == "bf16", "fp16_full_eval": False}
    if to == "fp32":
        flags["bf16_full_eval"] = False
    for key, value in flags.items():
        if hasattr(args, key) and getattr(args, key) != value:
            changed[f"args.{key}"] = f"{getattr(args, key)} -> {value}"
            setattr(args, key, value)
    mixed = "bf16" if to == "bf16" else "no"
    if getattr(args, "mixed_precision", mixed) != mixed:  # transformers >= 5 keeps it on the args
        changed["args.mixed_precision"] = f"{args.mixed_precision} -> {mixed}"
        args.mixed_precision = mixed
    if os.environ.get("ACCELERATE_MIXED_PRECISION", mixed) != mixed:  # older transformers use the env
        changed["env.ACCELERATE_MIXED_PRECISION"] = f"{os.environ['ACCELERATE_MIXED_PRECISION']} -> {mixed}"
        os.environ["ACCELERATE_MIXED_PRECISION"] = mixed


def _rebuild_accelerator(trainer, changed):
    """The Trainer built an Accelerator (autocast, GradScaler) from the old flags: build it again."""
    accelerator = getattr(trainer, "accelerator", None)
    if accelerator is None or accelerator.mixed_precision == args_mixed_precision(trainer.args):
        return
    from accelerate.state import AcceleratorState  # only a Trainer that exists has accelerate to import

    model = trainer.model
    if hasattr(model, "_original_forward"):  # prepare() wrapped forward in autocast + convert_to_fp32
        model.forward = model._original_forward
        del model._original_forward
    old = accelerator.mixed_precision
    AcceleratorState._reset_state()  # the shared state refuses a new mixed_precision otherwise
    trainer.create_accelerator_and_postprocess()
    changed["trainer.accelerator.mixed_precision"] = f"{old} -> {trainer.accelerator.mixed_precision}"


def _check_only(only, model=None) -> list[str] | None:
    """``only``: module names for the partial fp32 variant (None: the whole model switches)."""
    if only is None:
        return None
    if isinstance(only, str) or not all(isinstance(n, str) for n in only):
        raise ValueError(f"only must be a list of module names such as ['model.layers.3.mlp']; got {only!r}")
    for name in only if model is not None else ():
        try:
            model.get_submodule(name)
        except AttributeError:
            raise ValueError(f"only={name!r} is not a module of the model; use names from "
                             "model.named_modules() (the probe and the watch report them)") from None
    return list(only)


def _refuse_unsloth(target) -> None:
    """Unsloth chose the dtypes at load and rewrites the trainer's flags: casting behind its back
    would undo that (a float32-forced model would double its memory), so its own fix applies."""
    if read_unsloth(target.model, target.trainer, target.args).any:
        raise ValueError("this model (or trainer) was set up by Unsloth: switch-precision would undo what Unsloth "
                         "set; apply 'unsloth-precision' (Unsloth's flags and a reload with dtype=) instead")


def _switch(target, to=None, hardware=None, only=None, **_):
    _refuse_unsloth(target)
    only = _check_only(only, target.model)
    if only is not None:  # the variant for a model that does not fit the GPU in fp32
        if to not in (None, "fp32") or target.model is None:
            raise ValueError("only= is the partial fp32 variant: it needs model= and to='fp32'")
        changed = apply_partial_fp32(target.model, only)
        return {"to": "fp32", "scope": "partial", **changed} if changed else {}
    to = _resolve_to(to, hardware)
    changed = {}
    if target.args is not None:
        _switch_args(target.args, to, changed)
    if target.trainer is not None:
        _rebuild_accelerator(target.trainer, changed)
    if target.model is not None:
        casts = {}
        for name, p in target.model.named_parameters():
            if quantized_or_integer(p):
                continue
            dtype = weight_target(p, to)
            if dtype is not None:
                casts[name] = f"{dtype_name(p.dtype)} -> {dtype_name(dtype)}"
                p.data = p.data.to(dtype)
        if casts:
            changed["parameters"] = casts
            if target.trainer is None and target.args is None:  # a plain loop: its half inputs follow
                loop_inputs_apply(target.model, changed)
            if target.trainer is not None or target.optimizer is not None:
                _follow_optimizer_state(target.optimizer if target.optimizer is not None else target.trainer.optimizer,
                                        changed)
        compute = set_compute_dtype(target.model, torch.float32 if to == "fp32" else torch.bfloat16)
        if compute:
            changed["4bit_compute_dtype"] = compute
    return {"to": to, **changed} if changed else {}


def _follow_optimizer_state(optimizer, changed) -> None:
    """A trainer (or loop) that already trained keeps its optimizer, whose moments are still in the old dtype:
    the next step's fused update refuses mixed dtypes. Each state tensor follows its weight's new dtype."""
    moved = follow_weight_dtypes(optimizer) if optimizer is not None else 0
    if moved:
        changed["optimizer_state"] = f"{moved} state tensors follow their weights' dtype"


def _switch_code(names, to=None, hardware=None, only=None, **_):
    only = _check_only(only)
    if only is not None:
        return partial_fp32_code(names.model, only)
    to = _resolve_to(to, hardware)
    a, m, t = names.args, names.model, names.trainer
    mixed = "bf16" if to == "bf16" else "no"
    plain_loop = not a and not t
    header = f"Train in {to} instead of fp16{'/bf16' if to == 'fp32' else ''}."
    if plain_loop and to == "bf16":  # no Trainer to set bf16=True on: without the loop's autocast it computes in fp32
        header = ("Train in bf16 instead of fp16: trainable weights in float32, frozen ones in bfloat16; the loop\n"
                  "# computes in bf16 only under its torch.autocast(dtype=torch.bfloat16) (see the end of this cell).")
    code = f"""import torch

# {header}
"""
    if a:
        code += f"""import os

{a}.fp16 = False
{a}.bf16 = {to == "bf16"}
{a}.fp16_full_eval = False
"""
        if to == "fp32":
            code += f"{a}.bf16_full_eval = False\n"
        code += f"""if hasattr({a}, "mixed_precision"):
    {a}.mixed_precision = "{mixed}"
if "ACCELERATE_MIXED_PRECISION" in os.environ:  # older transformers pass it through the environment
    os.environ["ACCELERATE_MIXED_PRECISION"] = "{mixed}"
"""
    if t:
        code += f"""
# The trainer built its accelerator (autocast, GradScaler) from the old flags: rebuild it.
from accelerate.state import AcceleratorState

if hasattr({t}.model, "_original_forward"):
    {t}.model.forward = {t}.model._original_forward
    del {t}.model._original_forward
AcceleratorState._reset_state()
{t}.create_accelerator_and_postprocess()
"""
    if to == "fp32":
        rule = "_param.dtype in (torch.float16, torch.bfloat16)"
        cast = "torch.float32"
    else:
        rule = "_param.dtype == torch.float16"
        cast = "torch.float32 if _param.requires_grad else torch.bfloat16"
    code += f"""
# Weights stored in the old precision follow (trainable ones in float32).
_cast = 0
for _name, _param in {m}.named_parameters():
    if _param.is_floating_point() and {rule}:
        _param.data = _param.data.to({cast})
        _cast += 1
"""
    if t:
        code += f"""
# An optimizer that already stepped keeps its moments in the old dtype: they follow the weights.
{source(follow_weight_dtypes)}

if {t}.optimizer is not None:
    follow_weight_dtypes({t}.optimizer)
"""
    if plain_loop:  # a plain loop: its optimizer, and its own autocast / GradScaler lines
        code += loop_precision_code(names, to)
    compute = "torch.float32" if to == "fp32" else "torch.bfloat16"
    code += f"""
# bitsandbytes 4-bit layers cast their input to their own compute_dtype: move them too (the 4-bit
# weights stay quantised). When you reload, pass the same dtype:
#   BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype={compute}, ...)
for _module in {m}.modules():
    if type(_module).__module__.startswith("bitsandbytes") and hasattr(_module, "compute_dtype"):
        _module.compute_dtype = {compute}
        _module.compute_type_is_set = True
_qconfig = getattr(getattr({m}, "config", None), "quantization_config", None)  # (a plain nn.Module has no config)
if getattr(_qconfig, "load_in_4bit", False):
    _qconfig.bnb_4bit_compute_dtype = {compute}
"""
    return code


def _accelerate_wrapped(model: torch.nn.Module) -> torch.nn.Module | None:
    """The model when accelerate's prepare() wrapped its forward (autocast + fp32 outputs), else None."""
    return model if "forward" in vars(model) and callable(getattr(model, "_original_forward", None)) else None


def _switch_plan(step: CapturedStep, to: str | None = None, only: Any = None, **_: Any) -> ShadowPlan:
    if only is not None:  # the partial-fp32 variant: running all of it in fp32 would verify another cell
        raise NotCheckable("the partial variant (only=[layers] in fp32) has no shadow recipe yet; the full switch "
                           "can be checked with options={'switch-precision': {'to': 'fp32'}}")
    if to not in ("bf16", "fp32"):
        raise NotCheckable(f"switch-precision needs to='bf16' or 'fp32' to be verified; got {to!r}")
    plan = ShadowPlan()
    for name, p in step.eager.named_parameters():
        if quantized_or_integer(p):
            continue
        dtype = weight_target(p, to)
        if dtype is not None:
            plan.tensors[name] = p.detach().to(dtype)
            plan.changes[name] = f"{dtype_name(p.dtype)} -> {dtype_name(dtype)}"
    # 4-bit storage stays; the layers' compute dtype moves (set for the run, restored afterwards)
    compute = torch.float32 if to == "fp32" else torch.bfloat16
    for name, layer in four_bit_layers(step.eager):
        current: torch.dtype = getattr(layer, "compute_dtype")  # noqa: B009  (bitsandbytes' attribute)
        if current != compute:
            plan.attributes += [(layer, "compute_dtype", compute), (layer, "compute_type_is_set", True)]
            plan.changes[f"{name}.compute_dtype"] = f"{dtype_name(current)} -> {dtype_name(compute)}"
    captured = step.micro_batches[0].autocast if step.micro_batches else []
    if step.args is not None:
        _trainer_autocast(step, to, captured, plan)
    else:
        _loop_autocast(to, captured, plan)
        if plan.tensors:  # the loop cell's input cast, as its hook does it
            plan.batch = input_cast_batch(plan.autocast if plan.autocast is not None else captured)
    return plan


def _trainer_autocast(step: CapturedStep, to: str, captured: list, plan: ShadowPlan) -> None:
    """A Trainer: the cell sets its flags and rebuilds its accelerator, which enters the autocast."""
    device = model_device(step.eager).type
    try:
        regions = trainer_autocast("bf16" if to == "bf16" else "no", device)
    except PrecisionUnavailable as exc:
        raise NotCheckable(f"the cell's precision cannot run on this machine: {exc}") from None
    plan.autocast = regions
    wrapped = _accelerate_wrapped(step.eager)
    if wrapped is not None:  # prepare() wrapped forward in the old autocast; the cell rebuilds the accelerator
        plan.attributes.append((wrapped, "forward", wrapped._original_forward))
        plan.changes["accelerator autocast"] = autocast_text(regions) if regions else "off"
    elif regions != captured:
        plan.changes["autocast"] = f"{autocast_text(captured)} -> {autocast_text(regions)}"


def _loop_autocast(to: str, captured: list, plan: ShadowPlan) -> None:
    """A plain loop: the cell changes the weights only; the loop's own autocast moves as the note says."""
    half = [(d, t) for d, t in captured if t in HALF_DTYPES]
    if to == "fp32" and half:
        plan.autocast = []
        plan.changes["autocast"] = "off"
    elif to == "bf16" and any(t == torch.float16 for _, t in half):
        plan.autocast = [(d, torch.bfloat16 if t == torch.float16 else t) for d, t in captured]
        plan.changes["autocast"] = "float16 -> bfloat16"
    if plan.autocast is not None:
        plan.note = "in your own loop, change the dtype of your torch.autocast the same way"


register(Fix("switch-precision", "Switch the training precision",
             "Move fp16 training to bf16 (where the hardware has it) or fp32: the argument flags, the accelerator "
             "a Trainer built from them, and weights stored in the old precision.",
             _switch, _switch_code, needs="model-or-args",
             default_options=lambda hardware, fp16_in_use: {"to": switch_target(hardware, fp16_in_use)},
             plan=_switch_plan,
             treats=("overflow", "invalid-op"), rank=30))
