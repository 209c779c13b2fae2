"""Setups a library release cannot train: MXFP4 (gpt-oss) weights, and cuDNN attention's backward on Hopper.

Both are read from configuration and hardware, not from a step: the failures are CUDA-only (the MXFP4
kernels need Triton on a GPU, and on CPU transformers dequantises the checkpoint at load; the cuDNN
SDPA backend exists only on NVIDIA GPUs).
"""
from __future__ import annotations

import torch

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


@rule("cudnn-attention-nan-hopper", "warning")
def cudnn_attention_nan_hopper(ctx):
    """Hopper (sm90) + SDPA + a padding mask with the cuDNN attention backend on: its backward can return NaN."""
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
    return finding(
        "cudnn-attention-nan-hopper", "cuDNN attention on Hopper with a padding mask: the backward can return NaN",
        "On sm90 GPUs (H100/H200) SDPA may pick the cuDNN backend, whose backward has returned NaN gradients with a "
        "padding mask on several torch releases (pytorch#139298, \"Function 'ScaledDotProductCudnnAttentionBackward0' "
        "returned nan values\"). " + ("The sampled batches are padded. " if padding else "No batch was seen; padded "
                                      "batches are the affected case. ")
        + "Turn the cuDNN backend off with torch.backends.cuda.enable_cudnn_sdp(False) (SDPA then uses the flash or "
          "memory-efficient kernel), or load the model with another attention implementation.",
        {"compute_capability": [9, 0], "attn_implementation": "sdpa", "cudnn_sdp_enabled": True,
         "torch": str(torch_version), "padding_seen": padding},
        fixes=["disable-cudnn-sdp"])
