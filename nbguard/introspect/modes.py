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


ModuleModes = list[tuple[torch.nn.Module, bool]]


def module_modes(model: torch.nn.Module) -> ModuleModes:
    """Every module with its own train/eval flag (a module the user keeps in eval has its own)."""
    return [(m, m.training) for m in model.modules()]


def apply_modes(modes: ModuleModes) -> None:
    """Each module's flag set as recorded. Not ``model.train(was_training)``: that would switch the
    submodules a user keeps in eval (a frozen tower, dropout turned off) to train mode for the rest of the run."""
    for module, training in modes:
        module.training = training


@contextlib.contextmanager
def modes_restored(model: torch.nn.Module) -> Iterator[None]:
    """Whatever the block sets (``model.eval()``, ``model.train()``), every module's own flag put back after it."""
    modes = module_modes(model)
    try:
        yield
    finally:
        apply_modes(modes)


@contextlib.contextmanager
def in_training_mode(model: torch.nn.Module) -> Iterator[None]:
    """``model.train()`` as each training step calls it, then every module's own flag put back."""
    with modes_restored(model):
        model.train()
        yield


@contextlib.contextmanager
def in_eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """``model.eval()`` (no dropout: what the model computes without noise), then every module's own flag put back."""
    with modes_restored(model):
        model.eval()
        yield
