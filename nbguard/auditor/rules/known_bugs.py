"""Setups a library release cannot train: MXFP4 (gpt-oss) weights, and cuDNN attention's backward on Hopper.

MXFP4 is read from configuration (its kernels need Triton on a GPU; on CPU transformers dequantises the
checkpoint at load). The cuDNN case is checked by a probe on the GPU itself (cudnn_probe): the bug is tied to
releases, so it is warned about only where it reproduces.
"""
from __future__ import annotations

import torch

from ...findings import Severity
from ..cudnn_probe import probe_cudnn_sdpa_backward
from ..registry import finding, rule
from .padding import _attn_implementation


def quant_method(quantization_config) -> str | None:
    if quantization_config is None:
        return None
    get = quantization_config.get if isinstance(quantization_config, dict) else (
        lambda key, default=None: getattr(quantization_config, key, default))
    method = get("quant_method")
    return str(getattr(method, "value", method)).lower() if method is not None else None


@rule("mxfp4-not-trainable", "error")
def mxfp4_not_trainable(ctx):
    """MXFP4-quantised weights (gpt-oss) kept quantised: transformers refuses to train them."""
    q = ctx.quantization_config
    if quant_method(q) != "mxfp4":
        return None
    dequantize = q.get("dequantize", False) if isinstance(q, dict) else getattr(q, "dequantize", False)
    if dequantize:
        return None
    params = sum(p.numel() for _, p in ctx.named_params)
    return finding(
        "mxfp4-not-trainable", "the model is MXFP4-quantised: transformers will not train it",
        "The checkpoint's experts are stored in MXFP4, which has no backward: Trainer raises \"quantized with "
        "QuantizationMethod.MXFP4 but that quantization method do not support training\" (LoRA included). The "
        "options, decided before loading: load dequantised with quantization_config=Mxfp4Config(dequantize=True) "
        "and torch_dtype=torch.bfloat16 (about 2 bytes per parameter), then fine-tune with LoRA on top; or "
        "dequantise and re-quantise to 4-bit with bitsandbytes for QLoRA on a smaller GPU.",
        {"quant_method": "mxfp4", "dequantize": False, "parameters": params,
         "bf16_weights_gb": round(params * 2 / 1e9, 2) if params else None})


def _padding_seen(ctx) -> bool | None:
    """True/False when a batch was seen (any attention_mask zero), None when no batch."""
    masks = [b.get("attention_mask") for b in ctx.batches]
    masks = [m for m in masks if isinstance(m, torch.Tensor)]
    if not ctx.batches:
        return None
    return any(not bool(m.all()) for m in masks)


def _head_dim(config) -> int:
    explicit = getattr(config, "head_dim", None)
    if isinstance(explicit, int) and explicit > 0:
        return explicit
    return int(config.hidden_size // config.num_attention_heads)


@rule("cudnn-attention-nan-hopper", "warning")
def cudnn_attention_nan_hopper(ctx):
    """Hopper (sm90) + SDPA + a padding mask with the cuDNN attention backend on: a probe on this GPU says
    whether its backward returns NaN; a named Hopper profile (not this machine) is noted as unchecked."""
    hw = ctx.hardware
    if hw is None or hw.device_type != "cuda" or hw.compute_capability != (9, 0):
        return None
    if _attn_implementation(ctx.text_config) != "sdpa" or not torch.backends.cuda.cudnn_sdp_enabled():
        return None
    torch_version = ctx.version("torch")
    if torch_version is None or torch_version.release[:2] < (2, 5):  # the cuDNN SDPA backend arrived in 2.5
        return None
    padding = _padding_seen(ctx)
    if padding is False:
        return None
    facts = {"compute_capability": [9, 0], "attn_implementation": "sdpa", "cudnn_sdp_enabled": True,
             "torch": str(torch_version), "padding_seen": padding}
    dtype = ctx.weight_dtype if ctx.weight_dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
    probe = probe_cudnn_sdpa_backward(_head_dim(ctx.text_config), dtype) if hw.detected else None
    if probe is not None and probe.reproduced is False:
        return None  # checked on this GPU: its backward is finite
    if probe is not None and probe.reproduced:
        return finding(
            "cudnn-attention-nan-hopper", "cuDNN attention's backward returns NaN on this GPU with a padding mask",
            f"A probe of SDPA on the cuDNN backend (head dim {probe.head_dim}, {probe.dtype}, a padded batch) gave "
            "non-finite gradients on this GPU (pytorch#139298). Turn the cuDNN backend off with "
            "torch.backends.cuda.enable_cudnn_sdp(False) (SDPA then uses the flash or memory-efficient kernel), or "
            "load the model with another attention implementation.",
            {**facts, "probe": probe.to_evidence()}, fixes=["disable-cudnn-sdp"])
    why = probe.reason if probe is not None else f"the audit names {hw.display_name}, not this machine's GPU"
    return finding(
        "cudnn-attention-nan-hopper", "cuDNN attention on Hopper with a padding mask: not checked here",
        "NaN gradients from cuDNN attention's backward with a padding mask were reported on some torch releases "
        "(pytorch#139298), but not every release and cuDNN reproduce it (finite in 10 of 10 configurations on an "
        f"H200 with torch 2.11). It could not be checked: {why}. Run the audit on the Hopper GPU itself: a probe of "
        "a second then says whether this torch and cuDNN reproduce it.",
        {**facts, "probe": probe.to_evidence() if probe is not None else None}, severity=Severity.INFO)
