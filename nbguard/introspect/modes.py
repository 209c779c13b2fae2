"""Train/eval mode facts: dropout that evaluation left off inside a model that says it is training."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def applies_dropout(module: torch.nn.Module) -> bool:
    """nn.Dropout layers (LoRA's lora_dropout among them) with p > 0, and attention modules that drop
    attention weights by their own ``training`` flag (transformers' ``attention_dropout``)."""
    if isinstance(module, torch.nn.modules.dropout._DropoutNd):
        return module.p > 0
    rate = getattr(module, "attention_dropout", None)
    return isinstance(rate, float) and rate > 0


def dropout_in_eval(model: torch.nn.Module) -> list[str]:
    """Modules that apply dropout but are in eval mode, when the model's own flag says training (else [])."""
    if not model.training:
        return []
    return [name for name, m in model.named_modules() if not m.training and applies_dropout(m)]


@contextlib.contextmanager
def in_training_mode(model: torch.nn.Module) -> Iterator[None]:
    """``model.train()`` as each training step calls it, then every module's own flag put back."""
    modes = [(m, m.training) for m in model.modules()]
    try:
        model.train()
        yield
    finally:
        for module, mode in modes:
            module.training = mode
