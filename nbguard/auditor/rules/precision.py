"""Rules about which floating-point formats the run uses, and whether the hardware and model can take them."""
from __future__ import annotations

import torch

from ...introspect.dtypes import HALF_DTYPES, dtype_name
from ..registry import capped, finding, rule

FP16_MAX = 65504.0
# Families pretrained in bf16 whose activations are known to exceed the fp16 range.
FP16_UNSAFE_FAMILIES = {"gemma", "gemma2", "gemma3", "gemma3_text", "gemma3n", "gemma3n_text", "t5", "mt5"}


def _param_list(params, limit=10):
    return capped([f"{n}: {dtype_name(p.dtype)}" for n, p in params], limit)


def _bnb_compute_dtype(ctx):
    q = ctx.quantization_config
    if q is None:
        return None
    dtype = getattr(q, "bnb_4bit_compute_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.replace("torch.", ""), None)
    if dtype is None or not (getattr(q, "load_in_4bit", False) or getattr(q, "_load_in_4bit", False)):
        return None
    return dtype


@rule("bf16-unsupported", "error")
def bf16_unsupported(ctx):
    """bf16 asked for on hardware without native bf16 (compute capability < 8.0)."""
    if ctx.hardware.native_bf16:
        return None
    asks = []
    if getattr(ctx.args, "bf16", False):
        asks.append("args.bf16=True")
    if getattr(ctx.args, "bf16_full_eval", False):
        asks.append("args.bf16_full_eval=True")
    bf16_trainable = [(n, p) for n, p in ctx.trainable if p.dtype == torch.bfloat16]
    if bf16_trainable:
        asks.append(f"{len(bf16_trainable)} trainable parameters stored in bfloat16")
    if _bnb_compute_dtype(ctx) == torch.bfloat16:
        asks.append("bnb_4bit_compute_dtype=bfloat16")
    if not asks:
        return None
    hw = ctx.hardware
    cc = ".".join(map(str, hw.compute_capability)) if hw.compute_capability else None
    return finding(
        "bf16-unsupported",
        f"bf16 requested but {hw.display_name} has no native bf16",
        f"The {hw.display_name} (compute capability {cc}) has no bf16 tensor cores; native bf16 needs 8.0 or "
        "newer. PyTorch emulates it there (torch.cuda.is_bf16_supported() still says True), which is slow, "
        "and transformers refuses bf16=True on such GPUs. Train in fp32 (or fp16 with a model that fits its range).",
        {"hardware": hw.name, "compute_capability": cc, "requested_by": asks,
         "target_precision": hw.best_half_precision,
         **({"bf16_trainable_parameters": _param_list(bf16_trainable)} if bf16_trainable else {})},
        fixes=["switch-precision"],
    )


@rule("fp16-overflow-risk", "error")
def fp16_overflow_risk(ctx):
    """fp16 for a model family pretrained in bf16 that overflows fp16, or probed activations near 65504."""
    families = sorted(ctx.model_types & FP16_UNSAFE_FAMILIES)
    near = ctx.probe.near_limit() if ctx.probe is not None else []
    family_risk = bool(families) and ctx.uses_fp16
    if not family_risk and not near:
        return None
    target = ctx.hardware.best_half_precision
    evidence = {
        "hardware": ctx.hardware.name,
        "target_precision": target,
        "fp16_limit": FP16_MAX,
        "uses_fp16": ctx.uses_fp16,
        "fp16_from": [s for s, on in (("args.fp16", ctx.mixed_precision == "fp16"),
                                      ("args.fp16_full_eval", getattr(ctx.args, "fp16_full_eval", False)),
                                      ("float16 weights", ctx.weight_dtype == torch.float16)) if on],
    }
    parts = []
    if families:
        evidence["model_type"] = families
        parts.append(
            f"{'/'.join(families)} models are pretrained in bf16 and their activations (residual stream, MLP "
            "outputs) grow past 65504, the largest fp16 value; in fp16 they become inf and then NaN."
        )
    if near:
        evidence["modules_near_limit"] = capped(
            [{"module": m["module"], "absmax": m["absmax"], "input_absmax": m["input_absmax"],
              "headroom": m["headroom"]} for m in near])
        parts.append(
            f"The probe saw {len(near)} module(s) whose outputs or inputs reach at least half of 65504 "
            "(headroom <= 2x; an input that large was computed in the parent module, between two children); "
            "a slightly different batch or a few training steps push them past the fp16 range."
        )
    parts.append(f"Train in {target} on {ctx.hardware.display_name} instead.")
    severity = "error" if ctx.uses_fp16 else "warning"
    return finding(
        "fp16-overflow-risk",
        "fp16 will overflow for this model" if ctx.uses_fp16 else "activations are too large for fp16",
        " ".join(parts), evidence, fixes=["switch-precision"], severity=severity,
    )


@rule("trainable-low-precision", "warning")
def trainable_low_precision(ctx):
    """Trainable parameters (LoRA adapters included) stored in fp16/bf16."""
    half = ctx.trainable_half
    if not half:
        return None
    return finding(
        "trainable-low-precision",
        f"{len(half)} trainable parameters are stored in half precision",
        "The optimizer updates these parameters in fp16/bf16. bf16 keeps only 8 bits of mantissa, so an "
        "update smaller than about 1/256 of a weight rounds away and the weight stops learning; fp16 updates "
        "underflow and its gradients cannot be unscaled. Keep trainable weights (LoRA adapters, embeddings) "
        "in float32 and let autocast run the matmuls in half precision.",
        {"parameters": _param_list(half), "dtypes": sorted({dtype_name(p.dtype) for _, p in half})},
        fixes=["upcast-trainable-fp32"],
    )


@rule("fp16-unscale-error", "error")
def fp16_unscale_error(ctx):
    """fp16 mixed precision with fp16 trainable parameters: GradScaler raises on the first step."""
    if ctx.mixed_precision != "fp16":
        return None
    fp16 = [(n, p) for n, p in ctx.trainable if p.dtype == torch.float16]
    if not fp16:
        return None
    return finding(
        "fp16-unscale-error",
        "fp16 mixed precision with fp16 trainable weights",
        "With fp16=True the Trainer uses a GradScaler, which refuses to unscale gradients of fp16 "
        "parameters: the first optimizer step raises \"ValueError: Attempting to unscale FP16 gradients\". "
        "Trainable parameters must be float32 under fp16 mixed precision.",
        {"parameters": _param_list(fp16), "mixed_precision": "fp16"},
        fixes=["upcast-trainable-fp32"],
    )


@rule("mixed-param-dtypes", "warning")
def mixed_param_dtypes(ctx):
    """Both fp16 and bf16 parameters in one model: a half-precision matmul between them fails or overflows."""
    halves = {d for d in ctx.dtype_counts if d in HALF_DTYPES}
    if len(halves) < 2:
        return None
    by_dtype = {}
    for n, p in ctx.floating_params:
        if p.dtype in HALF_DTYPES:
            by_dtype.setdefault(dtype_name(p.dtype), []).append(n)
    return finding(
        "mixed-param-dtypes",
        "the model mixes float16 and bfloat16 parameters",
        "Some parameters are float16 and others bfloat16. Operations between them raise dtype-mismatch "
        "errors outside autocast, and the float16 part carries fp16's small range into a model that was "
        "meant to run in bf16. Usually part of the model was loaded or cast with a different torch_dtype.",
        {"counts": {dtype_name(d): c for d, c in ctx.dtype_counts.items()},
         **{f"{k}_parameters": capped(v) for k, v in by_dtype.items()}},
        fixes=["switch-precision"],
    )


@rule("bnb-compute-dtype", "warning")
def bnb_compute_dtype(ctx):
    """The 4-bit compute dtype disagrees with the training precision (or is float32, which is slow)."""
    dtype = _bnb_compute_dtype(ctx)
    if dtype is None:
        return None
    wanted = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(ctx.mixed_precision)
    if wanted is not None and dtype != wanted:
        reason = (f"the 4-bit layers compute in {dtype_name(dtype)} while training runs in "
                  f"{ctx.mixed_precision}: every quantised matmul casts back and forth"
                  + (" and fp16 compute brings back fp16's overflow risk." if dtype == torch.float16 else "."))
    elif dtype == torch.float32 and wanted is None and ctx.hardware.is_gpu:
        reason = "the 4-bit layers compute in float32 (the bitsandbytes default), which is several times slower."
    else:
        return None
    return finding(
        "bnb-compute-dtype",
        f"bnb_4bit_compute_dtype={dtype_name(dtype)} does not match the training precision",
        f"With bitsandbytes 4-bit weights, {reason} Set bnb_4bit_compute_dtype to the training precision "
        f"({ctx.hardware.best_half_precision if wanted is None else ctx.mixed_precision}) when loading the model.",
        {"bnb_4bit_compute_dtype": dtype_name(dtype), "mixed_precision": ctx.mixed_precision,
         "hardware": ctx.hardware.name},
    )
