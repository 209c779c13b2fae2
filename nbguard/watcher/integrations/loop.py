"""Step boundaries in a plain loop: optimizer step pre/post hooks and, with a GradScaler, its
``update`` (``scaler.step`` skips ``optimizer.step`` entirely when it found inf, so only
``update`` sees every step)."""
from __future__ import annotations

import torch

from .instance_wrap import InstanceWrap


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
    """The optimizer's step pre/post hooks and its ``zero_grad`` (an invisible instance wrapper,
    removed on detach): clearing gradients mid-step tells the watch that an interrupted step was
    abandoned."""

    def __init__(self, optimizer: torch.optim.Optimizer, pre, post, zero_grad=None):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self.optimizer = optimizer
        self.handles = [optimizer.register_step_pre_hook(pre), optimizer.register_step_post_hook(post)]
        self._zero_grad: InstanceWrap | None = None
        if zero_grad is not None:
            def cleared(original, *args, **kwargs):
                zero_grad()
                return original(*args, **kwargs)

            self._zero_grad = InstanceWrap(optimizer, "zero_grad", cleared)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        if self._zero_grad is not None:
            self._zero_grad.remove()
            self._zero_grad = None


class ScalerBinding:
    """Wraps one GradScaler instance's ``update`` (an invisible instance wrapper, removed on detach): the step's
    read before it, the step's end after it. The gradients are read wherever they are then (still
    scaled, or unscaled by ``unscale_``); ``grads_scaled`` tells the read which."""

    def __init__(self, scaler, before, after):
        if not callable(getattr(scaler, "update", None)) or not hasattr(scaler, "step"):
            raise TypeError(f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
        self.scaler = scaler

        def update(original, *args, **kwargs):
            before()
            result = original(*args, **kwargs)
            after()
            return result

        self._update = InstanceWrap(scaler, "update", update)

    def grads_scaled(self, optimizer) -> bool:
        """Whether ``optimizer``'s gradients are still multiplied by the loss scale (the scaler has
        not unscaled them this step)."""
        if not self.enabled:
            return False
        state = getattr(self.scaler, "_per_optimizer_states", {}).get(id(optimizer))
        stage = state.get("stage") if isinstance(state, dict) else None
        return stage is None or getattr(stage, "name", None) == "READY"

    def scale(self) -> torch.Tensor | None:
        if not self.enabled:
            return None
        scale = getattr(self.scaler, "_scale", None)
        return scale if isinstance(scale, torch.Tensor) else None

    @property
    def enabled(self) -> bool:
        return bool(getattr(self.scaler, "is_enabled", lambda: True)())

    def found_inf(self) -> torch.Tensor | None:
        """Sum of the scaler's found-inf flags for this step (read together with the sentinel).

        Whether ``optimizer.step`` ran says nothing: optimizers with ``_step_supports_amp_scaling``
        (fused AdamW, the Trainer's default) are always called and skip inside the kernel.
        """
        flags = [t for state in getattr(self.scaler, "_per_optimizer_states", {}).values()
                 for t in state.get("found_inf_per_device", {}).values() if isinstance(t, torch.Tensor)]
        if not flags:
            return None
        device = flags[0].device
        return torch.stack([t.to(device).float().reshape(()) for t in flags]).sum()

    def remove(self) -> None:
        self._update.remove()
