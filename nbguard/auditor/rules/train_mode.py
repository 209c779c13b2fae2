"""Dropout left off in training: modules in eval mode inside a model whose own flag says training.

``Trainer.evaluate`` calls ``model.eval()`` and each training step ``model.train()``; both walk the
registered submodules, unless a wrapper overrides ``train()`` with one that sets only its own flag.
Then after evaluation (or a sampling callback's ``inner.eval()``) the wrapper says training while the
inner model's dropout layers stay in eval: the run silently trains without dropout. The watch-side
twin, :class:`nbguard.watcher.detectors.train_mode.DropoutModeCheck`, checks the same after every step.
"""
from __future__ import annotations

from ...introspect.modes import dropout_in_eval
from ..registry import capped, finding, rule


@rule("dropout-off-in-training", "warning")
def dropout_off_in_training(ctx):
    """Dropout layers (p > 0) in eval mode inside a model whose own mode flag says training."""
    off = dropout_in_eval(ctx.model) if ctx.model is not None else []
    if not off:
        return None
    return finding(
        "dropout-off-in-training", f"{len(off)} dropout layer(s) are in eval mode while the model trains",
        "The model's own flag says training (model.training is True) but these dropout layers are in eval mode: "
        "a wrapper whose train() sets only its own flag left them as evaluation (or an inner .eval()) set them, "
        "and the Trainer's model.train() does not reach them. Training runs without the dropout it was configured "
        "with. Make the wrapper's train() call super().train(mode), or put those dropout layers back in training mode.",
        {"dropout_in_eval": capped(off), "model_training": True}, fixes=["dropout-train-mode"])
