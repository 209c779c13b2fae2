"""One dry forward+backward of a padded batch through a model with torchao Float8 or GPTQ/AWQ layers.

Quantised layers scale their inputs at every call, and a scale computed from the input can be 0.
torchao's ``Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())`` quantises each
activation row by its own amax: a row of zeros has amax 0, scale 0, and 0/0 gives NaN
(pytorch/ao#3356: LoRA on FP8 gives a NaN loss from step 1). A causal LM feeds such rows to its first
projections wherever it pads: the pad token's embedding row is zero (``padding_idx`` zeroes it at
init) and RMSNorm keeps a zero row zero. The batch decides, so the rule runs the model on one: the
trainer's sampled batch when it has padding, else a built one with a padded row. Every module is
hooked and the first one (in execution order) whose output is non-finite is named, through the
watch's own replay (``watcher/localise/replay.py``), which puts every gradient, float buffer, module mode and
RNG back and removes its hooks.
"""
from __future__ import annotations

from typing import Any

import torch

from ...introspect.quantized_layers import QuantizedLayer, read_quantized_layers
from ...step.batch import forward_kwargs, synthetic_batch
from ...step.capture import MicroBatch, capture_rng, preserved_rng
from ...step.precision import PrecisionUnavailable, args_mixed_precision, trainer_autocast
from ...watcher.localise.replay import Replayer
from ..registry import capped, finding, rule

RULE = "quantized-dry-pass-nonfinite"
LB_FIX = "float8-activation-lb"


def padded_rows(batch: dict[str, Any]) -> list[int]:
    """Rows holding padding: a 0 anywhere in their attention_mask."""
    mask = batch.get("attention_mask")
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        return []
    return [int(i) for i in (mask == 0).any(dim=1).nonzero().flatten()]


def _pad_id(ctx) -> int | None:
    tok = ctx.tokenizer
    for owner in (tok, ctx.text_config, ctx.config):
        pad = getattr(owner, "pad_token_id", None) if owner is not None else None
        if isinstance(pad, int):
            return pad
    return None


def padded_batch(model: torch.nn.Module, pad_id: int | None, left: bool = False,
                 seq_len: int = 16) -> dict[str, torch.Tensor]:
    """Two rows of token ids; the second padded over its last (``left``: first) half with ``pad_id``."""
    batch = synthetic_batch(model, batch_size=2, seq_len=seq_len)
    if pad_id is None:
        return batch
    half = slice(0, seq_len // 2) if left else slice(seq_len // 2, seq_len)
    batch["input_ids"][1, half] = pad_id
    batch["attention_mask"][1, half] = 0
    batch["labels"][1, half] = -100
    return batch


def choose_batch(ctx) -> tuple[dict[str, torch.Tensor], str]:
    """The first sampled batch with padding, else a built one with a padded row; and where it came from."""
    for batch in ctx.batches:
        if padded_rows(batch):
            return batch, ctx.sample.source
    left = getattr(ctx.tokenizer, "padding_side", "right") == "left"
    return padded_batch(ctx.model, _pad_id(ctx), left), "built (token ids within the vocabulary, one padded row)"


def _autocast(ctx, device: torch.device) -> list:
    args = ctx.args if ctx.args is not None else getattr(ctx.trainer, "args", None)
    if args is None:
        return []
    try:
        return trainer_autocast(args_mixed_precision(args), device.type)
    except PrecisionUnavailable:
        return []


def dry_pass(model: torch.nn.Module, batch: dict[str, torch.Tensor], autocast: list | None = None):
    """(Localisation, None) or (None, "ExceptionType: message"): one forward+backward of ``batch`` in
    training mode with every module hooked; the model's gradients, buffers, modes and RNGs are put back."""
    kwargs = forward_kwargs(model, batch)
    micro_batch = MicroBatch(0, (), kwargs, capture_rng(), list(autocast or []),
                             {"loss": torch.ones((), device=next((p.device for p in model.parameters()),
                                                                 torch.device("cpu")))})
    with preserved_rng():  # random and NumPy as well: the replay itself puts back torch's
        try:
            return Replayer(model).run([micro_batch]), None
        except (RuntimeError, NotImplementedError, ValueError, TypeError) as exc:
            return None, f"{type(exc).__name__}: {exc}"


def _cause(layer: QuantizedLayer | None, rows: list[int]) -> str:
    if layer is not None and layer.per_row_unbounded:
        return ("torchao quantises this layer's input row by row with no lower bound on the scale "
                "(activation_value_lb None): a row of zeros has amax 0 and scale 0, and 0/0 is NaN. "
                + ("The padded positions are such rows: the pad token's embedding row is zero and RMSNorm keeps it "
                   "zero. " if rows else "") +
                "Re-quantise with Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(), "
                "activation_value_lb=1e-12), the torchao maintainers' fix (pytorch/ao#3356).")
    if layer is not None:
        return (f"the first non-finite value comes out of a quantised layer ({layer.describe()}): its input scale "
                "or its dequantised weights made it, on this batch" + (" with padded rows" if rows else "") + ".")
    return ("the first non-finite value comes out of a module that is not itself quantised; the quantised layers "
            "around it may have fed it values it cannot hold.")


@rule(RULE, "error")
def quantized_dry_pass_nonfinite(ctx):
    """A dry forward+backward of a padded batch through torchao Float8 or GPTQ/AWQ layers is non-finite."""
    if ctx.model is None or any(p.device.type == "meta" for _, p in ctx.named_params[:1]):
        return None
    layers = read_quantized_layers(ctx.model, ctx.quantization_config, ctx.modules)
    if not layers.layers:
        return None
    batch, source = choose_batch(ctx)
    rows = padded_rows(batch)
    device = next((p.device for _, p in ctx.named_params), torch.device("cpu"))
    found, error = dry_pass(ctx.model, batch, _autocast(ctx, device))
    evidence: dict[str, Any] = {"batch_source": source, "padded_rows": rows, "inputs": sorted(batch),
                                "quantized_layers": layers.to_dict()}
    if error is not None:
        return finding(RULE, "the dry pass through the quantised layers raised",
                       f"A forward+backward of one padded batch ({source}) through the model's quantised layers "
                       f"({', '.join(layers.kinds)}) raised {error}. train() runs the same kernels on its first "
                       "step: on this device they may not support training (a backward through weights quantised "
                       "for inference, e.g. torchao's quantize_ on a device without its float8 kernels).",
                       {**evidence, "exception": error}, severity="warning")
    if not found.origins:
        return None
    origin = found.origins[0]
    layer = layers.find(origin.module)
    unbounded = [q.name for q in layers.layers if q.per_row_unbounded]
    quantization = layer.describe() if layer is not None else "not quantised"
    evidence.update({"module": origin.module, "phase": origin.phase, "quantization": quantization,
                     "cause": found.cause, "tensor": origin.tensor, "dtype": origin.dtype,
                     "per_row_without_lb": capped(unbounded)})
    return finding(
        RULE, f"NaN/Inf from {origin.module} on a padded batch",
        f"A dry forward+backward of one padded batch ({source}; padded rows {rows or 'none'}) first turned "
        f"non-finite in {origin.phase} at {origin.module} ({quantization}). {_cause(layer, rows)}",
        evidence, fixes=[LB_FIX] if unbounded else [])
