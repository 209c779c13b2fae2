"""The batch a step runs on: on the model's device, with the forward kwargs of a training step."""
from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch

from ..introspect.embeddings import embedding_shape


def model_device(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def synthetic_batch(model: torch.nn.Module, batch_size: int = 1, seq_len: int = 16) -> dict[str, torch.Tensor]:
    """Random token ids within the vocabulary, labels = inputs (a causal LM step)."""
    shape = embedding_shape(model)
    vocab = shape[0] if shape else int(getattr(getattr(model, "config", None), "vocab_size", 32))
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch_size, seq_len), generator=gen).to(model_device(model))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def forward_kwargs(model: torch.nn.Module, batch: dict[str, Any]) -> dict[str, Any]:
    """The batch on the model's device, with the KV cache off where the forward takes ``use_cache``."""
    device = model_device(model)
    kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    params: Mapping[str, inspect.Parameter]
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        params = {}
    if "use_cache" in params or any(p.kind is p.VAR_KEYWORD for p in params.values()):
        kwargs["use_cache"] = False  # a cache is not part of training and would only cost memory
    return kwargs
