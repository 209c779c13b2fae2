"""Rules about which floating-point formats the run uses, and whether the hardware and model can take them."""
from __future__ import annotations

import math

import torch

from ...document.view import plural
from ...introspect.dtypes import HALF_DTYPES, dtype_name
from ..checkpoint import checkpoint_dtype
from ..context import AuditContext
from ..registry import capped, finding, rule
from .dry_forward import describe_dtypes, parameter_dtypes

FP16_MAX = 65504.0
# Families pretrained in bf16 whose activations are known to exceed the fp16 range.
FP16_UNSAFE_FAMILIES = {"gemma", "gemma2", "gemma3", "gemma3_text", "gemma3n", "gemma3n_text", "t5", "mt5"}


def _param_list(params, limit=10):
    return capped([f"{n}: {dtype_name(p.dtype)}" for n, p in params], limit)


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
    if torch.bfloat16 in ctx.quantization.compute_dtype_set:  # the 4-bit layers' own compute dtype
        asks.append("bnb_4bit_compute_dtype=bfloat16")
    if not asks:
        return None
    hw = ctx.hardware
    cc = ".".join(map(str, hw.compute_capability)) if hw.compute_capability else None
    return finding(
        "bf16-unsupported",
        f"bf16 requested but {hw.display_name} has no native bf16",
        f"The {hw.display_name} (compute capability {cc}) has no bf16 tensor cores; native bf16 needs 8.0 or "
        "newer. PyTorch emulates it there and torch.cuda.is_bf16_supported() still says True, so current "
        "transformers accepts bf16=True and the run starts, but bf16 matmuls run without tensor cores (several "
        "times slower), and libraries that check the hardware themselves (vLLM, which TRL and Unsloth use for "
        "generation) refuse bf16 with \"Bfloat16 is only supported on GPUs with compute capability of at least "
        "8.0\". Train in fp32 (or fp16 with a model that fits its range).",
        {"hardware": hw.name, "compute_capability": cc, "requested_by": asks,
         "target_precision": hw.best_half_precision,
         **({"bf16_trainable_parameters": _param_list(bf16_trainable)} if bf16_trainable else {})},
        fixes=["switch-precision"],
    )


def _checkpoint_bf16(ctx: AuditContext) -> str | None:
    """Where the config says the checkpoint was saved in bf16 (a saved config.json or model.config.dtype)."""
    for cfg in ctx.configs:
        saved = checkpoint_dtype(cfg)
        if saved is not None:
            return saved[1] if saved[0] == "bfloat16" else None
    return None


def _grouped(items: list[dict], key: str) -> tuple[list[dict], list[dict], list[dict]]:
    """Probe entries split by what they saw: non-finite, at or over 65504, within 2x of it."""
    nonfinite = [m for m in items if not math.isfinite(m[key])]
    over = [m for m in items if math.isfinite(m[key]) and m[key] >= FP16_MAX]
    near = [m for m in items if math.isfinite(m[key]) and m[key] < FP16_MAX]
    return nonfinite, over, near


def _forward_probe_text(near: list[dict]) -> list[str]:
    peaks = [{**m, "peak": max(m["absmax"], m["input_absmax"]) if math.isfinite(m["absmax"] + m["input_absmax"])
              else float("nan")} for m in near]
    nonfinite, over, close = _grouped(peaks, "peak")
    parts = []
    if nonfinite:
        parts.append(f"In forward the probe saw {plural(len(nonfinite), 'module')} whose outputs or inputs are "
                     "already inf/NaN on this batch.")
    if over:
        worst = max(m["peak"] for m in over)
        parts.append(f"{plural(len(over), 'module')} {'reaches' if len(over) == 1 else 'reach'} values past 65504 "
                     f"(up to {worst:.3g}, {worst / FP16_MAX:.2g}x the limit): in fp16 they are inf on this batch.")
    if close:
        parts.append(f"{plural(len(close), 'module')} {'reaches' if len(close) == 1 else 'reach'} at least half of "
                     "65504 without passing it (headroom <= 2x; an input that large was computed in the parent "
                     "module, between two children): a slightly different batch or a few training steps can push "
                     "them past the fp16 range.")
    return parts


def _backward_probe_text(near_back: list[dict]) -> list[str]:
    nonfinite, over, close = _grouped(near_back, "grad_absmax")
    parts = []
    if nonfinite:
        parts.append(f"In backward {plural(len(nonfinite), 'module')} received inf/NaN gradients (the forward "
                     "values they came from were already non-finite, or overflowed on the way back).")
    finite = over + close
    if finite:
        worst = min(m["grad_headroom"] for m in finite if m["grad_headroom"] is not None)
        parts.append(
            f"In backward {plural(len(finite), 'module')} received a gradient "
            + (f"past 65504 ({len(over)} of them) " if over else "")
            + "of at least half of 65504 before any loss scaling. fp16 mixed precision multiplies gradients by "
            "the GradScaler's scale (65536 at the start), so every step overflows until the scale falls "
            + ("below 1" if worst < 1 else f"to {worst:.3g} or less")
            + ", and at such a scale the small gradients (LoRA adapters, late layers) round to zero in fp16.")
    return parts


@rule("fp16-overflow-risk", "error")
def fp16_overflow_risk(ctx):
    """fp16 for a model pretrained in bf16 (known family, or a checkpoint saved in bf16), or probed values near 65504."""
    families = sorted(ctx.model_types & FP16_UNSAFE_FAMILIES)
    saved_bf16 = _checkpoint_bf16(ctx) if ctx.uses_fp16 and not families else None
    near = ctx.probe.near_limit() if ctx.probe is not None else []
    near_back = ctx.probe.backward_near_limit() if ctx.probe is not None else []
    family_risk = bool(families) and ctx.uses_fp16
    if not family_risk and not saved_bf16 and not near and not near_back:
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
    if saved_bf16:
        evidence["checkpoint_dtype"] = "bfloat16"
        evidence["checkpoint_dtype_from"] = saved_bf16
        parts.append(
            "The checkpoint was saved in bfloat16, which usually means it was trained in bf16: nothing kept its "
            "activations inside fp16's range (65504), and bf16 has the range of fp32. Many such models overflow "
            "in fp16"
            + ("." if ctx.probe is not None else "; run nbguard.audit(..., probe=True) on a real batch to measure this one.")
        )
    if near:
        evidence["modules_near_limit"] = capped(
            [{"module": m["module"], "absmax": m["absmax"], "input_absmax": m["input_absmax"],
              "headroom": m["headroom"]} for m in near])
        parts += _forward_probe_text(near)
    if near_back:
        evidence["backward_near_limit"] = capped(
            [{"module": m["module"], "grad_absmax": m["grad_absmax"], "grad_headroom": m["grad_headroom"]}
             for m in near_back])
        finite = [m["grad_headroom"] for m in near_back if m["grad_headroom"] is not None]
        evidence["max_loss_scale"] = min(finite) if finite else None
        parts += _backward_probe_text(near_back)
    if ctx.uses_fp16:
        parts.append(f"Train in {target} on {ctx.hardware.display_name} instead.")
    else:
        parts.append("Nothing in this run is fp16, so this only matters if you switch to fp16.")
    certain = family_risk or bool(near) or bool(near_back)
    severity = ("error" if certain else "warning") if ctx.uses_fp16 else "info"
    return finding(
        "fp16-overflow-risk",
        "fp16 will overflow for this model" if severity == "error" else (
            "fp16 for a checkpoint saved in bf16" if ctx.uses_fp16 else "values are too large for fp16"),
        " ".join(parts), evidence, fixes=["switch-precision"] if ctx.uses_fp16 else [], severity=severity,
    )


@rule("precision-flag-ignored", "warning")
def precision_flag_ignored(ctx):
    """fp16=True where the backend ignores it (the CPU): accelerate trains fp32, with no autocast and no GradScaler."""
    if ctx.ignored_precision is None:
        return None
    why = ("use_cpu=True" if getattr(ctx.args, "use_cpu", False) else f"the hardware is {ctx.hardware.display_name}")
    # no autocast: the step computes in the weights' own dtypes, which are float32 only if the model was loaded so
    # (axolotl's bf16: auto on a machine without bf16 loads float16 weights and sets fp16=True)
    dtypes = parameter_dtypes([(n, p) for n, p in ctx.named_params if p.is_floating_point()])
    in_fp32 = set(dtypes) <= {"float32"}
    computes = ("every step computes in float32" if in_fp32 else
                f"every step computes in the weights' own dtypes ({describe_dtypes(dtypes)}), with nothing to "
                "reconcile two of them where they meet in one operation")
    return finding(
        "precision-flag-ignored",
        "fp16=True has no effect on the CPU: this run trains in fp32" if in_fp32 else
        f"fp16=True has no effect on the CPU: this run computes in its weights' {' and '.join(dtypes)}, with no autocast",
        f"The run is on the CPU ({why}). accelerate only turns fp16 mixed precision on off the CPU "
        "(Accelerator.native_amp stays False for fp16 on \"cpu\"), so there is no fp16 autocast and no GradScaler: "
        f"{computes}, and nothing here tells you whether fp16 would overflow. To check the run "
        "you mean to make on a GPU, audit it for that GPU (nbguard.audit(trainer, hardware=\"t4\"), or "
        "%precision_check trainer --hardware t4); bf16=True does run on the CPU (CPU autocast to bfloat16).",
        {"requested": ctx.requested_precision, "effective": "fp32" if in_fp32 else "+".join(dtypes), "device": "cpu",
         "because": why, "native_amp": False, "parameter_dtypes": {d: len(names) for d, names in dtypes.items()}},
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
        "The optimizer updates these parameters in fp16/bf16. bf16 keeps 8 significant bits (7 stored), so an "
        "update smaller than about 1/256 of a weight rounds away and the weight stops learning; fp16 keeps 11 "
        "bits but small updates underflow, and under fp16=True the GradScaler refuses to unscale its gradients. Keep trainable weights (LoRA adapters, embeddings) "
        "in float32 and let autocast run the matmuls in half precision.",
        {"parameters": _param_list(half), "dtypes": sorted({dtype_name(p.dtype) for _, p in half})},
        fixes=["upcast-trainable-fp32"],
    )


@rule("fp16-unscale-error", "error")
def fp16_unscale_error(ctx):
    """fp16 mixed precision with half-precision trainable parameters: GradScaler raises on the first step."""
    loop_scaler = ctx.scaler is not None and ctx.scaler.is_enabled()  # a plain loop's own GradScaler
    if ctx.mixed_precision != "fp16" and not loop_scaler:  # the effective precision: fp16 on the CPU has no GradScaler
        return None
    fp16 = [(n, p) for n, p in ctx.trainable if p.dtype == torch.float16]
    # The CUDA unscale kernel has no bfloat16 version (aten/src/ATen/native/cuda/AmpKernels.cu dispatches
    # FLOATING_TYPES_AND_HALF); the CPU one dispatches the reduced types too, so GradScaler("cpu") takes bf16.
    bf16 = [(n, p) for n, p in ctx.trainable if p.dtype == torch.bfloat16] if ctx.hardware.device_type == "cuda" else []
    if not fp16 and not bf16:
        return None
    errors = []
    if fp16:
        errors.append("float16 gradients raise \"ValueError: Attempting to unscale FP16 gradients\"")
    if bf16:
        errors.append("bfloat16 gradients raise \"RuntimeError: \"_amp_foreach_non_finite_check_and_unscale_cuda\" "
                      "not implemented for 'BFloat16'\" (the CUDA unscale kernel has no bf16 version)")
    return finding(
        "fp16-unscale-error",
        "fp16 mixed precision with half-precision trainable weights",
        ("Your loop's GradScaler" if loop_scaler and ctx.mixed_precision != "fp16" else
         "With fp16=True the Trainer uses a GradScaler, which")
        + " unscales the gradients of the trainable parameters "
        f"in place at the first optimizer step: {'; '.join(errors)}. Trainable parameters must be float32 under "
        "fp16 mixed precision (autocast still runs the matmuls in fp16)"
        + (", or train bf16 weights with bf16=True where the GPU has native bf16." if bf16 else "."),
        {"parameters": _param_list(fp16 + bf16), "dtypes": sorted({dtype_name(p.dtype) for _, p in fp16 + bf16}),
         "mixed_precision": "fp16", "hardware": ctx.hardware.name},
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
