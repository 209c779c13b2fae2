"""Rules for bitsandbytes-quantised models (QLoRA): the 4-bit compute dtype, 8-bit optimizer state."""
from __future__ import annotations

from typing import Any

import torch

from ...introspect.dtypes import dtype_name
from ...introspect.unsloth import float32_forced_without_autocast
from ..registry import capped, finding, rule
from .precision import FP16_UNSAFE_FAMILIES

_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def training_precision(ctx) -> str | None:
    """"fp16"/"bf16" from the mixed-precision flags, else what the weights are stored in."""
    if ctx.mixed_precision is not None:
        return ctx.mixed_precision
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(ctx.weight_dtype)


def fp16_overflow_evidence(ctx) -> list[str]:
    """Why this model's activations do not fit fp16, when something says so."""
    why = [f"model_type {t} overflows fp16" for t in sorted(ctx.model_types & FP16_UNSAFE_FAMILIES)]
    near = ctx.probe.near_limit() if ctx.probe is not None else []
    if near:
        why.append(f"the probe saw {len(near)} module(s) within 2x of 65504")
    return why


def _layer_evidence(ctx) -> dict[str, Any]:
    q = ctx.quantization
    if not q.layers_4bit:
        return {}
    return {"layers_4bit": len(q.layers_4bit), "compute_dtypes": dict(q.compute_dtypes),
            "quant_types": dict(q.quant_types),
            "config_compute_dtype": dtype_name(q.config_compute_dtype) if q.config_compute_dtype else None,
            "fp16_compute_layers": capped(q.layers_computing_in(torch.float16)),
            "lora_on_4bit": len(q.lora_wrapped), "kbit_prepared": q.kbit_prepared}


@rule("bnb-compute-dtype", "warning")
def bnb_compute_dtype(ctx):
    """The 4-bit layers compute in fp16 where the activations do not fit it, or in a dtype that
    disagrees with the training precision (read off each Linear4bit, not only the config)."""
    dtypes = ctx.quantization.compute_dtype_set
    if not dtypes or float32_forced_without_autocast(ctx.unsloth, ctx.mixed_precision):
        return None  # Unsloth's forced-float32 mode keeps 4-bit compute in fp16 on purpose (introspect/unsloth.py)
    precision = training_precision(ctx)
    wanted = _DTYPES.get(ctx.mixed_precision)
    overflow = fp16_overflow_evidence(ctx) if torch.float16 in dtypes else []
    severity = None
    if overflow:
        severity = "error"
        dtype = torch.float16
        reason = (f"the 4-bit layers compute in float16 (Linear4bit casts its input to its own compute_dtype, "
                  f"whatever the training precision, here {precision}), and this model's activations do not "
                  f"fit fp16: {'; '.join(overflow)}.")
    elif torch.float16 in dtypes and wanted is not None and wanted != torch.float16:
        dtype = torch.float16
        reason = (f"the 4-bit layers compute in float16 while training runs in {ctx.mixed_precision}: every "
                  "quantised matmul casts back and forth and fp16 compute brings back fp16's overflow risk.")
    elif wanted is not None and any(d != wanted for d in dtypes):
        dtype = next(d for d in dtypes if d != wanted)
        reason = (f"the 4-bit layers compute in {dtype_name(dtype)} while training runs in {ctx.mixed_precision}: "
                  "every quantised matmul casts back and forth.")
    elif dtypes == {torch.float32} and wanted is None and ctx.hardware.is_gpu and ctx.hardware.native_bf16:
        dtype = torch.float32
        reason = "the 4-bit layers compute in float32 (the bitsandbytes default), which is several times slower."
    else:
        return None
    target = ctx.hardware.best_half_precision if (overflow or wanted is None) else ctx.mixed_precision
    evidence = {"bnb_4bit_compute_dtype": dtype_name(dtype), "mixed_precision": ctx.mixed_precision,
                "hardware": ctx.hardware.name, **_layer_evidence(ctx)}
    if overflow:
        evidence.update(training_precision=precision, fp16_overflow=overflow, target_precision=target)
    return finding(
        "bnb-compute-dtype",
        f"4-bit layers compute in {dtype_name(dtype)}" + (", which overflows for this model" if overflow else
                                                         " but training runs in another precision"),
        f"With bitsandbytes 4-bit weights, {reason} Set the layers' compute dtype to {target} (switch-precision "
        f"does it on the loaded model) and reload with BitsAndBytesConfig(bnb_4bit_compute_dtype=...) to match.",
        evidence, fixes=["switch-precision"], severity=severity,
    )


# ---- 8-bit optimizer state on embeddings -------------------------------------------------------------
_8BIT_OPTIM_NAMES = ("8bit",)  # TrainingArguments.optim values: adamw_bnb_8bit, paged_adamw_8bit, lion_8bit, ...


def _bnb_optimizer(ctx) -> Any:
    opt = getattr(ctx.trainer, "optimizer", None)
    inner = getattr(opt, "optimizer", opt)  # accelerate's AcceleratedOptimizer
    return inner if type(inner).__module__.startswith("bitsandbytes") else None


def _optimizer_bits(ctx) -> tuple[int | None, str | None]:
    """(state bits, where that was read) of the optimizer the run uses or will build."""
    inner = _bnb_optimizer(ctx)
    bits = getattr(getattr(inner, "args", None), "optim_bits", None)
    if isinstance(bits, int):
        return bits, f"optimizer {type(inner).__name__}"
    optim = getattr(ctx.args, "optim", None)
    name = str(getattr(optim, "value", optim) or "")
    if any(tag in name for tag in _8BIT_OPTIM_NAMES):
        return 8, f"args.optim={name}"
    return None, None


def _overridden_to_32bit(module: torch.nn.Module | None, param: torch.nn.Parameter) -> bool:
    """bitsandbytes' GlobalOptimManager override ({"optim_bits": 32}) for this parameter, by
    ``override_config`` or ``register_module_override`` (which the Trainer does for nn.Embedding)."""
    try:
        from bitsandbytes.optim import GlobalOptimManager
    except Exception:  # bitsandbytes missing or without a usable backend: nothing overridden
        return False
    manager = GlobalOptimManager.get_instance()
    if manager.pid2config.get(id(param), {}).get("optim_bits") == 32:
        return True
    return any(getattr(m, attr, None) is param and config.get("optim_bits") == 32
               for m, attr, config in manager.module_weight_config_triple)


def _gets_8bit_state(ctx, owner: torch.nn.Module | None, param: torch.nn.Parameter, min_size: int) -> bool:
    """The optimizer's own state when it exists (uint8 moments), else bitsandbytes' rule: 8-bit for
    ``min_8bit_size`` values or more unless overridden; a Trainer overrides nn.Embedding weights."""
    inner = _bnb_optimizer(ctx)
    state = inner.state.get(param) if inner is not None else None
    if state and isinstance(state.get("state1"), torch.Tensor):
        return state["state1"].dtype == torch.uint8
    if param.numel() < min_size or _overridden_to_32bit(owner, param):
        return False
    trainer_will_override = ctx.trainer is not None or ctx.args is not None
    return not (trainer_will_override and isinstance(owner, torch.nn.Embedding))


def embedding_params(ctx) -> list[tuple[str, torch.nn.Module, torch.nn.Parameter]]:
    """Trainable parameters of the input/output embeddings (PEFT copies and LoRA factors included),
    with the module that owns each directly."""
    modules = []
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        fn = getattr(ctx.model, getter, None)
        try:
            module = fn() if callable(fn) else None
        except (NotImplementedError, AttributeError):
            module = None
        if module is not None:
            modules.append(module)
    owners = {id(p): sub for m in modules for sub in m.modules() for p in sub.parameters(recurse=False)}
    return [(n, owners[id(p)], p) for n, p in ctx.trainable if id(p) in owners]


@rule("bnb-8bit-embedding-state", "warning")
def bnb_8bit_embedding_state(ctx):
    """An 8-bit (or paged 8-bit) bitsandbytes optimizer keeps 8-bit state for trainable embeddings."""
    bits, source = _optimizer_bits(ctx)
    if bits != 8 or ctx.model is None:
        return None
    min_size = getattr(getattr(_bnb_optimizer(ctx), "args", None), "min_8bit_size", 4096)
    params = [(n, p) for n, owner, p in embedding_params(ctx) if _gets_8bit_state(ctx, owner, p, min_size)]
    if not params:
        return None
    return finding(
        "bnb-8bit-embedding-state",
        f"{len(params)} trainable embedding parameters get 8-bit optimizer state",
        f"The optimizer ({source}) keeps 8-bit Adam moments for every parameter of {min_size} values or more. "
        "bitsandbytes' own advice is 32-bit state for embeddings: their rare-token rows get tiny, sparse "
        "updates that 8-bit block quantisation rounds away or makes unstable. The Trainer overrides plain "
        "nn.Embedding weights only; the output head and PEFT's embedding adapters stay 8-bit. Override them "
        "before the optimizer is built: bitsandbytes.optim.GlobalOptimManager.get_instance()"
        ".override_config(param, 'optim_bits', 32).",
        {"optimizer": source, "min_8bit_size": min_size,
         "parameters": capped([f"{n}: {tuple(p.shape)}" for n, p in params])},
    )
