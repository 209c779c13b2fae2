"""FSDP with bitsandbytes 4-bit weights: the storage dtype of the packed weights must be the dtype FSDP
shards and casts the rest of the model in (accelerate#3983).

A ``Params4bit`` keeps its packed 4-bit codes in ``bnb_4bit_quant_storage`` (uint8 by default). FSDP treats it
as any other parameter: FSDP1 flattens each wrapped unit into one tensor of one floating dtype, so uint8
codes beside bf16 weights raise "Must flatten tensors with uniform dtype" (or "Cannot flatten integer dtype
tensors") at wrap; FSDP2 shards them, and its mixed-precision cast of the packed codes gives loss 0 and NaN
gradients. The recipe: store the codes in the FSDP mixed-precision dtype (``bnb_4bit_quant_storage=torch.bfloat16``
with ``dtype=torch.bfloat16`` for bf16), so every parameter FSDP sees has that one dtype.
"""
from __future__ import annotations

import os
from typing import Any

import torch

from ...introspect.dtypes import dtype_name
from ..registry import finding, rule

_MIXED = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _fsdp_args(args: Any) -> bool:
    fsdp = getattr(args, "fsdp", None)
    return bool(fsdp) and fsdp not in ("", [], "no")


def _fsdp_wrapped(model: Any) -> bool:
    """Wrapped already: an FSDP1 ``FullyShardedDataParallel`` or an FSDP2 ``fully_shard`` module."""
    return any(type(m).__module__.startswith("torch.distributed.fsdp") for m in model.modules())


def fsdp_in_use(ctx) -> str | None:
    """Where the run says it shards with FSDP: the Trainer's args, accelerate's launch config, the model."""
    args = ctx.args if ctx.args is not None else getattr(ctx.trainer, "args", None)
    if _fsdp_args(args):
        return "args.fsdp"
    if os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true"):
        return "accelerate launch (ACCELERATE_USE_FSDP)"
    if ctx.model is not None and _fsdp_wrapped(ctx.model):
        return "the model is FSDP-wrapped"
    return None


def _storage(ctx) -> dict[torch.dtype, int]:
    """How many 4-bit parameters store their codes in each dtype."""
    counts: dict[torch.dtype, int] = {}
    for _, p in ctx.named_params:
        if type(p).__name__ == "Params4bit":
            counts[p.dtype] = counts.get(p.dtype, 0) + 1
    return counts


@rule("bnb-fsdp-quant-storage", "error")
def fsdp_quant_storage(ctx):
    """FSDP over 4-bit bitsandbytes weights whose quant storage is not FSDP's mixed-precision dtype (uint8 by
    default): FSDP1 cannot flatten them, FSDP2 trains with loss 0 and NaN gradients."""
    if ctx.model is None:
        return None
    storage = _storage(ctx)
    where = fsdp_in_use(ctx) if storage else None
    if where is None:
        return None
    others = ctx.dtype_counts
    floating = [d for d, _ in others.most_common() if d.is_floating_point]
    wanted = _MIXED.get(ctx.requested_precision or "") or (floating[0] if floating else torch.float32)
    wrong = {d: n for d, n in storage.items() if d != wanted}
    if not wrong:
        return None
    stored = ", ".join(f"{dtype_name(d)} ({n} parameters)" for d, n in wrong.items())
    integer = any(not d.is_floating_point for d in wrong)
    name = dtype_name(wanted)
    return finding(
        "bnb-fsdp-quant-storage",
        f"FSDP with 4-bit weights stored in {', '.join(dtype_name(d) for d in wrong)}: FSDP needs {name}",
        f"The run shards with FSDP ({where}) and its 4-bit layers keep their packed codes in {stored}, while FSDP "
        f"shards and casts in {name}"
        + (f" (mixed precision {ctx.requested_precision})" if ctx.requested_precision else "") + ". "
        + ("FSDP1 flattens each wrapped unit into one floating tensor and raises 'Must flatten tensors with "
           "uniform dtype' or 'Cannot flatten integer dtype tensors' at wrap; FSDP2 shards the integer codes and "
           "its mixed-precision cast garbles them: loss 0 and NaN gradients (accelerate#3983). " if integer else
           "FSDP1 cannot flatten parameters of two dtypes into one unit, and FSDP2 casts the codes. ")
        + f"Reload with BitsAndBytesConfig(load_in_4bit=True, ..., bnb_4bit_quant_storage=torch.{name}) and "
        f"dtype=torch.{name}, so every parameter FSDP sees is {name}.",
        {"quant_storage": {dtype_name(d): n for d, n in storage.items()}, "fsdp": where,
         "fsdp_dtype": name, "mixed_precision": ctx.requested_precision,
         "fix": {"bnb_4bit_quant_storage": name, "dtype": name}})
