"""Known error signatures, one small function each.

A rule receives one exception of the chain and returns a :class:`Diagnosis` or None. Register
with ``@rule("stable-id")``; the id is the diagnosis' ``signature`` and never changes once shipped.
"""
from __future__ import annotations

import re
from collections.abc import Callable

from .diagnosis import Diagnosis, exception_text

Rule = Callable[[BaseException], "Diagnosis | None"]
RULES: dict[str, Rule] = {}


def rule(signature: str) -> Callable[[Rule], Rule]:
    def register(func: Rule) -> Rule:
        if signature in RULES:
            raise ValueError(f"duplicate explainer rule id {signature!r}")
        func.signature = signature
        RULES[signature] = func
        return func

    return register


def _diagnosis(signature: str, exc: BaseException, title: str, detail: str, fixes=(), options=None, **evidence):
    fixes = list(fixes)
    options = dict(options or {})
    if "switch-precision" in fixes and "switch-precision" not in options:
        options["switch-precision"] = {"to": _best_precision_here()}
    return Diagnosis(signature, title, detail, exception_text(exc), fixes, evidence, options)


def _best_precision_here() -> str:
    """bf16 where this machine's device has it natively, else fp32."""
    from ..hardware import detect

    try:
        return detect().best_half_precision
    except Exception:  # detection must never turn an explanation into a second error
        return "fp32"


_ANOMALY_NAN = re.compile(r"Function '(\w+)' returned nan values in its (\d+)(?:st|nd|rd|th) output")


@rule("anomaly-nan-output")
def anomaly_nan_output(exc):
    match = _ANOMALY_NAN.search(str(exc))
    if not match:
        return None
    function, index = match.group(1), int(match.group(2))
    compiled = function.startswith("Compiled")
    where = (
        "inside a torch.compile region, so anomaly mode cannot say which module it was"
        if compiled
        else f"in the backward of {function}, which names an operation, not the module it ran in"
    )
    detail = (
        f"torch.autograd.detect_anomaly saw a NaN gradient {where}. Anomaly mode also slows every "
        "step 1.5-3x. nbguard.watch (or %nanwatch) checks each optimizer step for almost nothing and, "
        "on the first bad step, replays it eagerly with hooks on every module to name the module where "
        "the NaN was born, in forward or backward: turn anomaly mode off and run "
        "`watch = nbguard.watch(trainer)` (or `nbguard.watch(model, optimizer=optimizer)`), then "
        "look at `watch.events[0].origins`."
    )
    return _diagnosis(
        "anomaly-nan-output", exc, f"NaN gradient in the backward of {function}", detail,
        function=function, output_index=index, compiled=compiled,
    )


_CACHE_FLOAT = re.compile(r"'(\w*Cache)' object has no attribute 'float'")


@rule("cache-float-crash")
def cache_float_crash(exc):
    match = _CACHE_FLOAT.search(str(exc)) if isinstance(exc, AttributeError) else None
    if not match:
        return None
    detail = (
        f"During evaluation the model returned its key/value cache ({match.group(1)}) among its outputs, "
        "and accelerate's conversion of outputs to float32 (used with bf16/fp16 mixed precision) called "
        ".float() on it. This happens with transformers 4.50.x caches that carry a dtype. The cache is "
        "of no use while training: turn it off with model.config.use_cache = False."
    )
    return _diagnosis(
        "cache-float-crash", exc, f"Evaluation crashed converting the {match.group(1)} to float32", detail,
        ["disable-use-cache"], cache_class=match.group(1),
    )


@rule("fp16-unscale-error")
def fp16_unscale_error(exc):
    if "Attempting to unscale FP16 gradients" not in str(exc):
        return None
    detail = (
        "The GradScaler of fp16 mixed precision unscales gradients in place and refuses fp16 gradients: "
        "the parameters being trained are stored in float16 (for example a model loaded with "
        "torch_dtype=torch.float16, LoRA adapters included). Mixed precision wants float32 trainable "
        "weights; autocast still runs the matmuls in fp16. Upcast the trainable parameters to float32."
    )
    return _diagnosis(
        "fp16-unscale-error", exc, "fp16 mixed precision with fp16 trainable parameters", detail,
        ["upcast-trainable-fp32"],
    )


_DTYPE_MISMATCH = (
    re.compile(r"expected (?:m1|mat1) and (?:m2|mat2) to have the same dtype, but got: ([\w:]+) != ([\w:]+)"),
    re.compile(r"expected (?:m1|mat1) and (?:m2|mat2) to have the same dtype"),
    re.compile(r"mat1 and mat2 must have the same dtype"),
    re.compile(r"expected scalar type (\w+) but found (\w+)"),
)


def _dtype_name(text: str) -> str:
    return {"float": "float32", "Float": "float32", "Half": "float16", "BFloat16": "bfloat16",
            "double": "float64", "Double": "float64"}.get(text.replace("c10::", ""), text.replace("c10::", ""))


@rule("matmul-dtype-mismatch")
def matmul_dtype_mismatch(exc):
    message = str(exc)
    match = next((m for m in (p.search(message) for p in _DTYPE_MISMATCH) if m), None)
    if not match:
        return None
    dtypes = [_dtype_name(g) for g in match.groups()]
    seen = f" ({' and '.join(dtypes)})" if dtypes else ""
    detail = (
        f"Two tensors of different dtypes{seen} met in a matrix multiply. Outside autocast PyTorch does "
        "not convert between float32 and float16/bfloat16: this happens when part of the model (an "
        "adapter, a new head, the inputs) has another dtype than the rest and training runs without "
        "mixed precision. Run under mixed precision (bf16=True or fp16=True in TrainingArguments, or "
        "torch.autocast) or keep one dtype for the whole model."
    )
    return _diagnosis(
        "matmul-dtype-mismatch", exc, "Matrix multiply of mismatched dtypes" + seen, detail,
        ["switch-precision"], dtypes=dtypes,
    )


@rule("no-grad-input")
def no_grad_input(exc):
    if "element 0 of tensors does not require grad" not in str(exc):
        return None
    detail = (
        "backward() was called on a loss that no trainable parameter contributed to. With gradient "
        "checkpointing on a PEFT (LoRA) model, the frozen embeddings return a tensor that does not "
        "require grad, so the checkpointed blocks record no graph. Make the embedding outputs require "
        "grad (model.enable_input_require_grads()), or check that some parameters are trainable."
    )
    return _diagnosis(
        "no-grad-input", exc, "The loss has no gradient path to a trainable parameter", detail,
        ["enable-input-require-grads"],
    )


_BF16_UNSUPPORTED = re.compile(
    r"doesn't support bf16|does not support bfloat16|bf16 (?:is )?not supported|"
    r"type bf16 not supported|bfloat16 is not supported|bf16 mixed precision requires",
    re.IGNORECASE,
)


@rule("bf16-unsupported")
def bf16_unsupported(exc):
    if not _BF16_UNSUPPORTED.search(str(exc)):
        return None
    detail = (
        "bf16 was asked for on a device without native bf16 (native bf16 needs an NVIDIA GPU of compute "
        "capability 8.0 or newer: A100, L4, A10G, RTX 30xx/40xx, H100; a T4 or V100 has none, even where "
        "torch.cuda.is_bf16_supported() answers True by emulation). Train in fp32 there (fp16 only for "
        "models pretrained in fp16), or use a GPU with native bf16."
    )
    return _diagnosis(
        "bf16-unsupported", exc, "bf16 is not supported on this device", detail, ["switch-precision"],
        options={"switch-precision": {"to": "fp32"}},
    )


@rule("sampling-nonfinite-probs")
def sampling_nonfinite_probs(exc):
    if "probability tensor contains either" not in str(exc):
        return None
    detail = (
        "Sampling (generate with do_sample=True, or torch.multinomial) got logits that were NaN or Inf. "
        "In half precision this is usually an activation overflow: models pretrained in bf16 (Gemma and "
        "others) exceed float16's limit of 65504. Run the model in bf16 or fp32, or find the module with "
        "nbguard.audit(model, probe=True)."
    )
    return _diagnosis(
        "sampling-nonfinite-probs", exc, "Sampling from NaN/Inf probabilities", detail, ["switch-precision"],
    )


@rule("loss-scale-minimum")
def loss_scale_minimum(exc):
    if "loss scale already at minimum" not in str(exc).lower():
        return None
    detail = (
        "The dynamic loss scaler of fp16 training (DeepSpeed or apex) halved its scale on every step "
        "because the gradients overflowed every time, until it hit its floor: fp16 cannot hold this "
        "model's activations or gradients. Train in bf16 where the GPU has it, else fp32, or lower the "
        "learning rate if the loss diverged first."
    )
    return _diagnosis(
        "loss-scale-minimum", exc, "fp16 loss scale collapsed to its minimum", detail,
        ["switch-precision", "lower-learning-rate"],
    )


@rule("nbguard-stopped")
def nbguard_stopped(exc):
    from ..errors import NonFiniteError

    if not isinstance(exc, NonFiniteError):
        return None
    event = getattr(exc, "event", None)
    if event is None:
        return _diagnosis("nbguard-stopped", exc, "nbguard stopped training", str(exc))
    origin = event.origins[0] if event.origins else None
    where = f" in {origin.module} ({origin.phase})" if origin is not None else ""
    detail = (
        f"The watch's 'stop' policy ended training at optimizer step {event.step}: {event.message}. "
        "The bad update was not applied, so the trainable weights are the last good ones. Look at "
        "watch.events[-1].origins for where the value was born, fix the cause, and continue training."
    )
    evidence = {"kind": event.kind, "step": event.step, "cause": event.cause}
    if origin is not None:
        evidence["origin"] = origin.to_dict()
    # the watch ran the candidate fixes on this step: offer the verified ones, and carry every verdict
    verification = event.evidence.get("verification")
    from ..fixes import FIXES

    verified = [v for v in (verification or {}).get("verdicts", [])
                if v.get("verdict") == "verified" and v.get("fix") in FIXES]
    diagnosis = _diagnosis("nbguard-stopped", exc, f"Stopped at step {event.step}: {event.kind}{where}", detail,
                           [v["fix"] for v in verified], {v["fix"]: v.get("options") or {} for v in verified},
                           **evidence)
    diagnosis.verification = verification
    return diagnosis
