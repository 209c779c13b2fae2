"""Step boundaries in a plain loop: optimizer step pre/post hooks and, with a GradScaler, its
``update`` (``scaler.step`` skips ``optimizer.step`` entirely when it found inf, so only
``update`` sees every step); the closure of ``optimizer.step(closure)``; the loss at the root of
``backward()``."""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from ..core.guard import OnError, warn_failure
from .instance_wrap import InstanceWrap, patch


def unwrap_optimizer(optimizer):
    """The torch optimizer inside wrappers such as accelerate's ``AcceleratedOptimizer``, whose
    ``step`` calls the inner optimizer's (where the step hooks run)."""
    for _ in range(4):
        inner = getattr(optimizer, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            break
        optimizer = inner
    return optimizer


def step_closure(args: tuple, kwargs: dict) -> Callable[[], Any] | None:
    """The closure an ``optimizer.step`` call was given, as torch's step pre-hook sees the call
    (``args[0]`` is the optimizer itself): Lightning's automatic optimization, LBFGS."""
    closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
    return closure if callable(closure) else None


def with_closure(args: tuple, kwargs: dict, closure: Callable[[], Any]) -> tuple[tuple, dict]:
    """The step call's ``(args, kwargs)`` with ``closure`` in place of the one it was given (a step
    pre-hook's return value)."""
    if "closure" in kwargs:
        return args, {**kwargs, "closure": closure}
    return (args[0], closure, *args[2:]), kwargs


def then_after_first_call(closure: Callable[[], Any], after: Callable[[Any], None]) -> Callable[[], Any]:
    """``closure`` unchanged, followed once by ``after(its result)``: a closure's first call runs the
    step's forward and backward, before the optimizer moves anything (LBFGS calls it again for its line
    search, on weights it has already moved)."""
    called = False

    @functools.wraps(closure, updated=())  # (a closure may be an object: its attributes stay its own)
    def closure_then_check(*args: Any, **kwargs: Any) -> Any:
        nonlocal called
        result = closure(*args, **kwargs)
        if not called:
            called = True
            after(result)
        return result

    return closure_then_check


class BackwardRoots:
    """``torch.autograd.backward`` (what ``tensor.backward()``, ``fabric.backward``,
    ``accelerator.backward`` and ``scaler.scale(loss).backward()`` all end in) hands ``took`` the
    scalar it started from: the loss wherever the user computed it, also after the model
    (``loss_fn(logits, y)``). Only a backward that went through the watched model counts: ``backwards()``
    (the watch's count of backwards through its model) moved during the call."""

    def __init__(self, backwards: Callable[[], int], took: Callable[[torch.Tensor], None], on_error: OnError):
        def around(call, *args, **kwargs):
            before = backwards()
            result = call(*args, **kwargs)
            root = _scalar_root(args[0] if args else kwargs.get("tensors"))
            if root is not None and backwards() != before:
                took(root.detach())
            return result

        self._patch = patch(torch.autograd, "backward", around, on_error)

    def remove(self) -> None:
        self._patch.remove()


def _scalar_root(tensors: Any) -> torch.Tensor | None:
    """The one scalar a backward starts from (``loss`` or ``[loss]``); None for anything else."""
    if isinstance(tensors, (list, tuple)) and len(tensors) == 1:
        tensors = tensors[0]
    return tensors if isinstance(tensors, torch.Tensor) and tensors.numel() == 1 else None


class OptimizerBinding:
    """The optimizer's step pre/post hooks and its ``zero_grad`` (an invisible instance wrapper,
    removed on detach): clearing gradients mid-step tells the watch that an interrupted step was
    abandoned."""

    def __init__(self, optimizer: torch.optim.Optimizer, pre, post, zero_grad=None, on_error: OnError = warn_failure):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self.optimizer = optimizer
        self.handles = [optimizer.register_step_pre_hook(pre), optimizer.register_step_post_hook(post)]
        self._zero_grad: InstanceWrap | None = None
        if zero_grad is not None:
            def cleared(original, *args, **kwargs):
                zero_grad()
                return original(*args, **kwargs)

            self._zero_grad = InstanceWrap(optimizer, "zero_grad", cleared, on_error)

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

    def __init__(self, scaler, before, after, on_error: OnError = warn_failure):
        if not callable(getattr(scaler, "update", None)) or not hasattr(scaler, "step"):
            raise TypeError(f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
        self.scaler = scaler

        def update(original, *args, **kwargs):
            before()
            result = original(*args, **kwargs)
            after()
            return result

        self._update = InstanceWrap(scaler, "update", update, on_error)

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
