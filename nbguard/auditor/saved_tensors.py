"""Saved tensors that hold nothing: zero-element ones, and all-zero ones that training cannot leave at zero.

Under DeepSpeed ZeRO-3 every parameter outside a gather is an empty placeholder (ZeRO-3 sets ``param.data``
to a tensor of 0 elements and keeps the values in its own partitions), so a ``save_pretrained`` that does not
gather writes ``shape [0]`` tensors (trl#4416, peft#2892); a gather that went wrong writes zeros. LoRA's A
matrices start random (Kaiming), so an all-zero lora_A was never the trained one; lora_B starts at zero, and
biases may be zero, so those are left to the rules that compare logits.
"""
from __future__ import annotations

from typing import Any

import torch

NAMED = 10  # tensors named per kind in the evidence


def _may_be_zero(name: str) -> bool:
    return ".lora_B." in name or name.endswith("lora_B.weight") or "lora_embedding_B" in name or "bias" in name


def hollow_tensors(state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """``empty``: the zero-element tensors (name -> shape); ``all_zero``: the all-zero tensors that cannot be
    zero after training (every tensor but lora_B and biases); with their counts."""
    empty = {k: list(t.shape) for k, t in state.items() if t.numel() == 0}
    zero = [k for k, t in state.items() if t.numel() and not _may_be_zero(k) and not bool(t.ne(0).any())]
    return {"empty": dict(list(empty.items())[:NAMED]), "empty_count": len(empty), "all_zero": zero[:NAMED],
            "all_zero_count": len(zero), "tensors": len(state)}
