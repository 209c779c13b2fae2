"""Step boundaries in a plain loop: optimizer step pre/post hooks and, with a GradScaler, its
``update`` (``scaler.step`` skips ``optimizer.step`` entirely when it found inf, so only
``update`` sees every step)."""
from __future__ import annotations

import torch


def unwrap_optimizer(optimizer):
    """The torch optimizer inside wrappers such as accelerate's ``AcceleratedOptimizer``, whose
    ``step`` calls the inner optimizer's (where the step hooks run)."""
    for _ in range(4):
        inner = getattr(optimizer, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            break
        optimizer = inner
    return optimizer


class OptimizerBinding:
    def __init__(self, optimizer: torch.optim.Optimizer, pre, post):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self.optimizer = optimizer
        self.handles = [optimizer.register_step_pre_hook(pre), optimizer.register_step_post_hook(post)]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


class ScalerBinding:
    """Wraps one GradScaler instance's ``update`` (an instance attribute, removed on detach)."""

    def __init__(self, scaler, before, after):
        if not callable(getattr(scaler, "update", None)) or not hasattr(scaler, "step"):
            raise TypeError(f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
        self.scaler = scaler
        self._had_own = "update" in vars(scaler)
        self._own = vars(scaler).get("update")
        original = scaler.update

        def update(*args, **kwargs):
            before()
            result = original(*args, **kwargs)
            after()
            return result

        update.__nbguard__ = True
        scaler.update = update

    def scale(self) -> torch.Tensor | None:
        if not getattr(self.scaler, "is_enabled", lambda: True)():
            return None
        scale = getattr(self.scaler, "_scale", None)
        return scale if isinstance(scale, torch.Tensor) else None

    def remove(self) -> None:
        if self._had_own:
            self.scaler.update = self._own
        else:
            vars(self.scaler).pop("update", None)
