"""Real bitsandbytes 4-bit models for the QLoRA tests (CPU backend; tiny configs, no downloads)."""
from __future__ import annotations

import torch

from nbguard.testing import tiny_4bit

TARGETS = ["q_proj", "v_proj"]


def qlora(family: str = "llama", compute_dtype=torch.float16, dtype=None, prepare: bool = False,
          targets=TARGETS, adapter_dtype_fp32: bool = True, **lora):
    """A 4-bit model with LoRA adapters, optionally through prepare_model_for_kbit_training first."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    model = tiny_4bit(family, compute_dtype=compute_dtype, dtype=dtype)
    if prepare:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    config = LoraConfig(**{"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": list(targets), **lora})
    return get_peft_model(model, config, autocast_adapter_dtype=adapter_dtype_fp32)


def q_proj(model, layer: int = 0):
    """PEFT's LoRA wrapper around layer ``layer``'s 4-bit q_proj."""
    return model.base_model.model.model.layers[layer].self_attn.q_proj


def scale_4bit(layer, factor: float) -> None:
    """Multiply a Linear4bit's dequantised weight by ``factor`` through its quantisation scales
    (absmax): the 4-bit codes stay, the layer's outputs grow by ``factor``."""
    state = layer.weight.quant_state
    state.absmax.mul_(factor)
