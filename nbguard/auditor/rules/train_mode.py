"""Dropout left off in training: modules in eval mode inside a model whose own flag says training.

``Trainer.evaluate`` calls ``model.eval()`` and each training step ``model.train()``; both walk the
registered submodules, unless a wrapper overrides ``train()``/``eval()`` or holds the inner model
outside its registered children. Then the wrapper's flag says training while the inner model's
dropout layers stay in eval after the first evaluation: the run silently trains without dropout.
"""
from __future__ import annotations

import torch

from ..registry import capped, finding, rule


def dropout_in_eval(model: torch.nn.Module) -> list[str]:
    """Dropout modules with p > 0 that are in eval mode."""
    return [name for name, m in model.named_modules()
            if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0 and not m.training]


def dropout_left_off_finding(model: torch.nn.Module, when: str):
    """The finding when ``model`` says training but some of its dropout layers are in eval, else None."""
    if not model.training:
        return None
    off = dropout_in_eval(model)
    if not off:
        return None
    return finding(
        "dropout-off-in-training", f"{len(off)} dropout layer(s) are in eval mode while the model trains",
        f"{when} the model's own flag says training (model.training is True) but these dropout layers are in eval "
        "mode: a wrapper whose train()/eval() does not reach the inner model (an override, or an inner model held "
        "outside the registered submodules) left them as evaluation set them. Training runs without the dropout "
        "it was configured with. Make the wrapper's train() call super().train(mode), or call model.train() on the "
        "inner model.", {"dropout_in_eval": capped(off), "model_training": True}, fixes=["train-mode-everywhere"])


@rule("dropout-off-in-training", "warning")
def dropout_off_in_training(ctx):
    """Dropout layers (p > 0) in eval mode inside a model whose own mode flag says training."""
    if ctx.model is None:
        return None
    return dropout_left_off_finding(ctx.model, "Now")
