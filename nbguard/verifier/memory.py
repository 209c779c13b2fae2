"""How much memory a shadow step adds, estimated before it runs, and the budget it must fit.

The estimate is deliberately simple and on the high side: the new tensors a fix substitutes, one
set of gradients for the trainable weights (``autograd.grad`` returns new tensors), and the
activations autograd keeps for one micro-batch: every module's output (what a leaf module saves
for backward is of that order) plus eager attention's score matrices, in float32.
"""
from __future__ import annotations

from typing import Any

import torch

from ..step.tensors import iter_tensors

SAFETY = 2.0  # activations: outputs plus their gradients in backward
DEFAULT_SHARE = 0.5  # of the free memory a shadow step may use when no budget is given


def _tokens(micro_batch) -> tuple[int, int]:
    """(tokens, sequence length) of the micro-batch's largest integer input (the token ids)."""
    best = (0, 0)
    for _, t in list(iter_tensors(micro_batch.args)) + list(iter_tensors(micro_batch.kwargs)):
        if not t.is_floating_point() and t.dim() >= 2 and t.numel() > best[0]:
            best = (t.numel(), t.shape[-1])
        elif t.is_floating_point() and t.dim() >= 3 and t.shape[:-1].numel() > best[0]:  # inputs_embeds
            best = (t.shape[:-1].numel(), t.shape[-2])
    return best


def _output_widths(model: torch.nn.Module) -> int:
    """Sum over leaf modules of their output width (out_features / embedding_dim / normalised size)."""
    width = 0
    for m in model.modules():
        if next(m.children(), None) is not None:
            continue
        for attr in ("out_features", "embedding_dim"):
            value = getattr(m, attr, None)
            if isinstance(value, int):
                width += value
                break
        else:
            weight = getattr(m, "weight", None)
            if isinstance(weight, torch.Tensor) and weight.dim() == 1:
                width += weight.shape[0]
    return width


def estimate_step_bytes(model: torch.nn.Module, micro_batches: list, substituted: dict[str, torch.Tensor]) -> dict[str, int]:
    """The parts of the estimate (bytes) and their total."""
    grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    new = sum(t.numel() * t.element_size() for t in substituted.values())
    tokens, seq = max((_tokens(mb) for mb in micro_batches), default=(0, 0))
    cfg = getattr(model, "config", None)
    getter = getattr(cfg, "get_text_config", None)
    text = getter() if callable(getter) else cfg
    heads = getattr(text, "num_attention_heads", 0) or 0
    layers = getattr(text, "num_hidden_layers", 0) or 0
    activations = int(tokens * _output_widths(model) * 4 * SAFETY + tokens * seq * heads * layers * 4 * SAFETY)
    return {"gradients": grads, "substituted": new, "activations": activations,
            "total": grads + new + activations}


def free_bytes(device: torch.device) -> int | None:
    """Free memory on the model's device (None when it cannot be told)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def default_budget(model: torch.nn.Module) -> int | None:
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    free = free_bytes(device)
    return int(free * DEFAULT_SHARE) if free is not None else None


def check_budget(budget: Any) -> int | None:
    if budget is None:
        return None
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or budget <= 0:
        raise ValueError(f"memory_budget must be a positive number of bytes (e.g. 8e9) or None for half the free "
                         f"memory; got {budget!r}")
    return int(budget)


def gb(n: int | None) -> str:
    return "?" if n is None else f"{n / 1e9:.3g} GB" if n >= 1e8 else f"{n / 1e6:.3g} MB"
