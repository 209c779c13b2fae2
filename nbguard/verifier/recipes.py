"""How to run each fix on a shadow: one recipe per fix id, turning the fix into a ``ShadowPlan``.

A recipe receives the captured step and the fix's options and returns the plan (new tensors,
autocast, attributes, a batch correction, a gradient clip), never changing the model. It raises
``NotCheckable(reason)`` when the fix cannot be judged on one step. A fix without a recipe comes
out "not checked" with that reason. To add one::

    @recipe("my-fix")
    def _my_fix(step: CapturedStep, **options) -> ShadowPlan:
        return ShadowPlan(tensors={...}, changes={...})
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..fixes import FIXES
from ..fixes.config_fixes import resolve_attn
from ..fixes.data_fixes import supervised_rows
from ..fixes.model_fixes import model_configs
from ..fixes.trainer_fixes import weight_target
from ..introspect.dtypes import HALF_DTYPES, QUANTIZED_PARAM_CLASSES, dtype_name
from ..introspect.embeddings import embedding_matrices, padding_row, token_deltas, zero_mask, zero_rows
from ..step.batch import model_device
from ..step.precision import PrecisionUnavailable, autocast_text, trainer_autocast
from .shadow import CapturedStep, ShadowPlan


class NotCheckable(Exception):
    """The fix cannot be judged on the failing step; the message says why."""


PlanBuilder = Callable[..., ShadowPlan]


@dataclass(frozen=True)
class Recipe:
    fix_id: str
    plan: PlanBuilder  # plan(step, **options) -> ShadowPlan


RECIPES: dict[str, Recipe] = {}


def recipe(fix_id: str) -> Callable[[PlanBuilder], PlanBuilder]:
    """Register the shadow plan of a registered fix (a recipe for an unknown fix id would offer a cell nobody has)."""
    def register(plan: PlanBuilder) -> PlanBuilder:
        if fix_id not in FIXES:
            raise ValueError(f"a verification recipe for {fix_id!r}, which is not a registered fix (nbguard.fixes)")
        if fix_id in RECIPES:
            raise ValueError(f"a verification recipe for {fix_id!r} is registered twice")
        RECIPES[fix_id] = Recipe(fix_id, plan)
        return plan
    return register


def _quantized(p: torch.Tensor) -> bool:
    return type(p).__name__ in QUANTIZED_PARAM_CLASSES or not p.is_floating_point()


# ---- model fixes -------------------------------------------------------------------------------
@recipe("upcast-trainable-fp32")
def _upcast(step: CapturedStep, **_: Any) -> ShadowPlan:
    plan = ShadowPlan()
    for name, p in step.eager.named_parameters():
        if p.requires_grad and not _quantized(p) and p.dtype != torch.float32:
            plan.tensors[name] = p.detach().float()
            plan.changes[name] = f"{dtype_name(p.dtype)} -> float32"
    return plan


@recipe("init-new-embeddings")
def _init_embeddings(step: CapturedStep, **_: Any) -> ShadowPlan:
    """The rows init-new-embeddings would set, computed on copies (the same selection as its apply)."""
    model, plan = step.eager, ShadowPlan()
    pad = padding_row(model)
    with torch.no_grad():
        for name, w in embedding_matrices(model):
            zero = zero_mask(w, keep=pad)
            trained = ~(w == 0).all(dim=1)
            if zero.any() and trained.any():
                new = w.detach().clone()
                new[zero] = w[trained].float().mean(dim=0).to(w.dtype)
                plan.tensors[name] = new
                plan.changes[name] = {"rows": int(zero.sum())}
        for name, adapter, delta, indices in token_deltas(model):
            rows = zero_rows(delta)
            if len(rows):
                base: torch.Tensor = model.get_submodule(name).base_layer.weight  # type: ignore[union-attr,assignment]
                idx = torch.tensor(indices, device=base.device)[rows.to(base.device)]
                new = delta.detach().clone()
                new[rows] = base[idx].to(delta.dtype).to(delta.device)
                key = f"{name}.trainable_tokens_delta.{adapter}"
                plan.tensors[key] = new
                plan.changes[key] = {"rows": len(rows)}
    return plan


def four_bit_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """bitsandbytes 4-bit layers: they cast their input to their own ``compute_dtype``."""
    return [(n, m) for n, m in model.named_modules()
            if type(m).__module__.startswith("bitsandbytes") and isinstance(getattr(m, "compute_dtype", None), torch.dtype)]


def _accelerate_wrapped(model: torch.nn.Module) -> torch.nn.Module | None:
    """The model when accelerate's prepare() wrapped its forward (autocast + fp32 outputs), else None."""
    return model if "forward" in vars(model) and callable(getattr(model, "_original_forward", None)) else None


@recipe("switch-precision")
def _switch_precision(step: CapturedStep, to: str | None = None, only: Any = None, **_: Any) -> ShadowPlan:
    if only is not None:  # the partial-fp32 variant: running all of it in fp32 would verify another cell
        raise NotCheckable("the partial variant (only=[layers] in fp32) has no shadow recipe yet; the full switch "
                           "can be checked with options={'switch-precision': {'to': 'fp32'}}")
    if to not in ("bf16", "fp32"):
        raise NotCheckable(f"switch-precision needs to='bf16' or 'fp32' to be verified; got {to!r}")
    plan = ShadowPlan()
    for name, p in step.eager.named_parameters():
        if _quantized(p):
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


@recipe("disable-use-cache")
def _disable_cache(step: CapturedStep, **_: Any) -> ShadowPlan:
    plan = ShadowPlan()
    for path, cfg in model_configs(step.eager):
        if getattr(cfg, "use_cache", False):
            plan.attributes.append((cfg, "use_cache", False))
            plan.changes[f"{path}.use_cache"] = "True -> False"
    return plan


@recipe("set-attn-implementation")
def _set_attn(step: CapturedStep, to: str | None = None, **_: Any) -> ShadowPlan:
    """The attention implementation on every config the model reads it from, for the run only."""
    chosen = resolve_attn(step.eager, to)
    plan = ShadowPlan()
    for path, cfg in model_configs(step.eager):
        old = getattr(cfg, "_attn_implementation", None)
        if old != chosen:
            plan.attributes.append((cfg, "_attn_implementation", chosen))
            plan.changes[f"{path}._attn_implementation"] = f"{old} -> {chosen}"
    return plan


@recipe("enable-input-require-grads")
def _input_grads(step: CapturedStep, **_: Any) -> ShadowPlan:
    raise NotCheckable("it changes which tensors require grad (reentrant checkpointing), not any value of the step")


# ---- training-argument fixes ------------------------------------------------------------------
@recipe("enable-grad-clipping")
def _clip(step: CapturedStep, max_norm: float = 1.0, **_: Any) -> ShadowPlan:
    return ShadowPlan(clip_grad_norm=float(max_norm), changes={"max_grad_norm": max_norm},
                      note="clipping scales this step's gradients; it cannot make a non-finite one finite")


@recipe("lower-learning-rate")
def _lower_lr(step: CapturedStep, **_: Any) -> ShadowPlan:
    raise NotCheckable("the learning rate does not enter the failing step's forward or backward; it changes only "
                       "the updates after it")


# ---- data fixes: verified on the corrected batch ------------------------------------------------
def _drop_unsupervised(args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    labels = kwargs.get("labels")
    if not isinstance(labels, torch.Tensor):  # nothing to judge rows by: leave the micro-batch as it is
        return args, kwargs
    keep = supervised_rows(labels)
    if bool(keep.all()):
        return args, kwargs
    if not bool(keep.any()):
        return None  # the whole micro-batch goes
    rows = labels.shape[0]

    def take(v: Any) -> Any:
        return v[keep] if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == rows else v

    return tuple(take(a) for a in args), {k: take(v) for k, v in kwargs.items()}


@recipe("drop-unsupervised-rows")
def _drop_rows(step: CapturedStep, **_: Any) -> ShadowPlan:
    if not any(isinstance(mb.kwargs.get("labels"), torch.Tensor) for mb in step.micro_batches):
        raise NotCheckable("the step's labels did not reach the model (the trainer keeps them), so the corrected "
                           "batch cannot be built from what was captured")
    dropped = 0
    for mb in step.micro_batches:
        labels = mb.kwargs.get("labels")
        if isinstance(labels, torch.Tensor):
            dropped += int((~supervised_rows(labels)).sum())
    if not dropped:
        return ShadowPlan()
    return ShadowPlan(batch=_drop_unsupervised, changes={"rows dropped": dropped})


def _repad_right(args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """The batch a right-padding tokenizer gives: each row's leading padding moved to its end."""
    mask = kwargs.get("attention_mask")
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        return args, kwargs
    lead = (mask.cumsum(dim=1) == 0).sum(dim=1)  # leading zeros per row
    rows, length = mask.shape
    index = (torch.arange(length, device=mask.device)[None, :] + lead[:, None]) % length

    def move(v: Any) -> Any:
        if isinstance(v, torch.Tensor) and v.dim() == 2 and tuple(v.shape) == (rows, length):
            return v.gather(1, index.to(v.device))
        return v

    return tuple(move(a) for a in args), {k: move(v) for k, v in kwargs.items()}


@recipe("pad-right-for-training")
def _pad_right(step: CapturedStep, **_: Any) -> ShadowPlan:
    """Verified on the corrected batch: the same rows, padded on the right."""
    repadded = 0
    for mb in step.micro_batches:
        mask = mb.kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 2:
            repadded += int(((mask[:, 0] == 0) & (mask.sum(dim=1) > 0)).sum())
    if not repadded:
        return ShadowPlan()
    return ShadowPlan(batch=_repad_right, changes={"rows re-padded on the right": repadded})
