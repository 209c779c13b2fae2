"""Fixes that change the model: parameter dtypes, config flags, embeddings, input-grad hooks."""
from __future__ import annotations

from typing import Any

import torch

from ..introspect.dtypes import QUANTIZED_PARAM_CLASSES, dtype_name, quantized_or_integer
from ..introspect.embeddings import embedding_matrices, padding_row, token_deltas, zero_mask, zero_rows
from ..step.plan import CapturedStep, NotCheckable, ShadowPlan
from .loop_cells import (
    follow_weight_dtypes,
    half_inputs_to_float32,
    input_cast_batch,
    install_input_cast,
    loop_inputs_apply,
    loop_inputs_code,
    loop_optimizer_code,
    source,
)
from .registry import Fix, register


# ---- upcast-trainable-fp32 -------------------------------------------------------------------
def _upcast(target, **_):
    changed = {}
    for name, p in target.model.named_parameters():
        if type(p).__name__ in QUANTIZED_PARAM_CLASSES:  # quantised storage: never cast
            continue
        if p.requires_grad and p.is_floating_point() and p.dtype != torch.float32:
            changed[name] = f"{dtype_name(p.dtype)} -> float32"
            p.data = p.data.float()
    if changed and target.trainer is None and target.args is None:  # a plain loop: what it needs with fp32 weights
        loop_inputs_apply(target.model, changed)
        moved = follow_weight_dtypes(target.optimizer) if target.optimizer is not None else 0
        if moved:
            changed["optimizer_state"] = f"{moved} state tensors follow their weights' dtype"
    return changed


def _upcast_code(names, **_):
    code = f"""import torch

# Keep every trainable parameter (LoRA adapters, trained embeddings) in float32; autocast still
# runs the matmuls in half precision. Quantised (4/8-bit) storage is not floating point: untouched.
_cast = 0
for _name, _param in {names.model}.named_parameters():
    if _param.requires_grad and _param.is_floating_point() and _param.dtype != torch.float32:
        _param.data = _param.data.float()
        _cast += 1
"""
    if names.loop:  # a plain loop: its half inputs and its optimizer's moments follow the weights
        code += loop_inputs_code(names.model)
        if names.optimizer:
            code += loop_optimizer_code(names.optimizer)
    return code


def _upcast_plan(step: CapturedStep, **_: Any) -> ShadowPlan:
    plan = ShadowPlan()
    for name, p in step.eager.named_parameters():
        if p.requires_grad and not quantized_or_integer(p) and p.dtype != torch.float32:
            plan.tensors[name] = p.detach().float()
            plan.changes[name] = f"{dtype_name(p.dtype)} -> float32"
    if plan.tensors and step.args is None:  # a plain loop's cell casts its half inputs (the same function)
        plan.batch = input_cast_batch(step.micro_batches[0].autocast if step.micro_batches else [])
        if plan.batch is not None:
            plan.changes["inputs"] = "float16/bfloat16 -> float32"
    return plan


register(Fix("upcast-trainable-fp32", "Keep trainable parameters in float32",
             "Cast every parameter that requires grad to float32, leaving frozen and quantised weights alone.",
             _upcast, _upcast_code, plan=_upcast_plan,
             treats=("overflow", "invalid-op"), rank=20))


# ---- cast-inputs-to-float32 ------------------------------------------------------------------
def _cast_inputs(target, **_):
    changed: dict[str, str] = {}
    loop_inputs_apply(target.model, changed)
    return changed


def _cast_inputs_code(names, **_):
    return f"""import torch

# The model's weights are float32 and it is given float16/bfloat16 tensors (x.half(), inputs_embeds,
# pixel_values): outside torch.autocast the first matmul refuses them. Cast them before every forward.
{source(half_inputs_to_float32, install_input_cast)}

install_input_cast({names.model})
"""


def _cast_inputs_plan(step: CapturedStep, **_: Any) -> ShadowPlan:
    plan = ShadowPlan(batch=input_cast_batch(step.micro_batches[0].autocast if step.micro_batches else []))
    if plan.batch is not None:
        plan.changes["inputs"] = "float16/bfloat16 -> float32"
    return plan


register(Fix("cast-inputs-to-float32", "Cast half-precision inputs to float32 before the forward",
             "A forward pre-hook on the model: float16/bfloat16 tensors it is given become float32 outside "
             "torch.autocast, for float32 weights fed half-precision inputs.",
             _cast_inputs, _cast_inputs_code, plan=_cast_inputs_plan))


# ---- disable-use-cache -----------------------------------------------------------------------
def model_configs(model):
    cfg = getattr(model, "config", None)
    if cfg is None:
        return []
    out = [("config", cfg)]
    getter = getattr(cfg, "get_text_config", None)
    text = getter() if callable(getter) else getattr(cfg, "text_config", None)
    if text is not None and text is not cfg:
        out.append(("config.text_config", text))
    return out


def _disable_cache(target, **_):
    changed = {}
    for path, cfg in model_configs(target.model):
        if getattr(cfg, "use_cache", False):
            cfg.use_cache = False
            changed[f"{path}.use_cache"] = "True -> False"
    return changed


def _disable_cache_code(names, **_):
    m = names.model
    return f"""# Training never reads the KV cache; building one in evaluation is what crashes (and costs memory).
# The model's config and its language model's (multimodal models keep use_cache in text_config).
for _config in ({m}.config, {m}.config.get_text_config()):
    if getattr(_config, "use_cache", False):
        _config.use_cache = False
"""


def _disable_cache_plan(step: CapturedStep, **_: Any) -> ShadowPlan:
    plan = ShadowPlan()
    for path, cfg in model_configs(step.eager):
        if getattr(cfg, "use_cache", False):
            plan.attributes.append((cfg, "use_cache", False))
            plan.changes[f"{path}.use_cache"] = "True -> False"
    return plan


register(Fix("disable-use-cache", "Turn off the KV cache for training",
             "Set use_cache=False in the model config and its text config.", _disable_cache, _disable_cache_code,
             plan=_disable_cache_plan))


# ---- init-new-embeddings ---------------------------------------------------------------------
def _init_embeddings(target, **_):
    changed = {}
    pad = padding_row(target.model)
    with torch.no_grad():
        for name, w in embedding_matrices(target.model):
            zero = zero_mask(w, keep=pad)
            trained = ~(w == 0).all(dim=1)
            if zero.any() and trained.any():
                w[zero] = w[trained].float().mean(dim=0).to(w.dtype)
                changed[name] = {"rows": int(zero.sum())}
        for name, adapter, delta, indices in token_deltas(target.model):
            rows = zero_rows(delta)
            if len(rows):
                base = _base_weight(target.model, name)
                idx = torch.tensor(indices, device=base.device)[rows.to(base.device)]
                delta[rows] = base[idx].to(delta.dtype).to(delta.device)
                changed[f"{name}.trainable_tokens_delta.{adapter}"] = {"rows": len(rows)}
    return changed


def _base_weight(model, module_name):
    module = model.get_submodule(module_name)
    return module.base_layer.weight


def _init_embeddings_code(names, **_):
    m = names.model
    return f"""import torch

# New tokens whose embedding rows are all zero start at the mean of the trained rows. Every
# (vocab, hidden) matrix is one of the embeddings: input, output head, PEFT copies; tied ones once.
# The padding row stays zero (nn.Embedding's padding_idx).
with torch.no_grad():
    _emb = next(x for x in {m}.get_input_embeddings().modules() if isinstance(x, torch.nn.Embedding))
    _shape, _pad = _emb.weight.shape, _emb.padding_idx
    _seen = set()
    for _name, _w in {m}.named_parameters():
        if _w.shape != _shape or _w.is_meta or _w.data_ptr() in _seen:
            continue
        _seen.add(_w.data_ptr())
        _trained = ~(_w == 0).all(dim=1)
        _zero = ~_trained
        if _pad is not None:
            _zero[_pad] = False
        if _zero.any() and _trained.any():
            _w[_zero] = _w[_trained].float().mean(dim=0).to(_w.dtype)
    # PEFT trainable_token_indices: each chosen token trains its own row, copied from the base row.
    for _module in {m}.modules():
        for _adapter, _delta in getattr(_module, "trainable_tokens_delta", {{}}).items():
            _zero = (_delta == 0).all(dim=1)
            if _zero.any():
                _idx = torch.tensor(_module.token_indices[_adapter], device=_delta.device)
                _delta[_zero] = _module.base_layer.weight[_idx[_zero]].to(_delta.dtype)
"""


def _init_embeddings_plan(step: CapturedStep, **_: Any) -> ShadowPlan:
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


register(Fix("init-new-embeddings", "Initialise zero embedding rows from the mean",
             "Set all-zero rows of the input/output embeddings (and PEFT copies) to the mean of the trained rows.",
             _init_embeddings, _init_embeddings_code, plan=_init_embeddings_plan,
             treats=("overflow", "invalid-op"), rank=10))


# ---- enable-input-require-grads --------------------------------------------------------------
def _has_input_grad_hook(model) -> bool:
    return any(getattr(m, "_require_grads_hook", None) is not None for m in model.modules())


def _enable_input_grads(target, **_):
    model = target.model
    if _has_input_grad_hook(model):
        return {}
    if not callable(getattr(model, "enable_input_require_grads", None)):
        raise ValueError("enable-input-require-grads needs a transformers (or PEFT) model; "
                         f"{type(model).__name__} has no enable_input_require_grads()")
    model.enable_input_require_grads()
    return {"input_embeddings": "output now requires grad (forward hook)"}


def _enable_input_grads_code(names, **_):
    m = names.model
    return f"""# With frozen embeddings (PEFT) and reentrant checkpointing, the layer inputs must require grad.
if getattr({m}, "_require_grads_hook", None) is None:
    {m}.enable_input_require_grads()
"""


def _input_grads_plan(step: CapturedStep, **_: Any) -> ShadowPlan:
    raise NotCheckable("it changes which tensors require grad (reentrant checkpointing), not any value of the step")


register(Fix("enable-input-require-grads", "Make the embedding output require grad",
             "Hook the input embeddings so their output requires grad (needed by reentrant checkpointing).",
             _enable_input_grads, _enable_input_grads_code, plan=_input_grads_plan))
