"""Recognising Liger kernels on a model or a trainer, and whether Triton can run them here.

Nothing here imports liger_kernel; each marker was read in its source (liger-kernel 0.8.5):

- ``TrainingArguments.use_liger_kernel`` (also TRL's configs, which inherit it): transformers applies
  ``liger_kernel.transformers._apply_liger_kernel_to_instance`` at the start of ``train()``
  (transformers/integrations/liger.py), so before ``train()`` the model carries no marker yet.
- ``_apply_liger_kernel_to_instance`` / ``apply_liger_kernel_to_<family>(model=...)`` bind Liger's
  functions onto the instances (monkey_patch.py ``_bind_method_to_module``: ``module.__dict__["forward"]``)
  and replace ``model.forward`` with ``<family>_lce_forward`` (liger_kernel/transformers/model/*.py),
  which computes the loss with the fused linear cross-entropy and returns ``logits=None``.
  ``apply_liger_kernel_to_<family>()`` without a model patches the transformers classes instead.
- Triton's kernels need an active driver (triton/runtime/driver.py raises "0 active drivers" at the
  first launch without one), unless ``TRITON_INTERPRET`` was set before the kernels were defined
  (``@triton.jit`` reads it then: the kernel is an ``InterpretedFunction``).
- ``LigerFusedLinearCrossEntropyLoss(reduction="none")`` returned wrong weight/bias gradients under a
  per-token upstream gradient (Liger-Kernel#968), fixed by PR #1298, first released in 0.8.2.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from ..environment import parsed_version

LIGER = "liger_kernel"
FLCE_CLASS = "LigerFusedLinearCrossEntropyLoss"
REDUCTION_NONE_FIXED = "0.8.2"  # Liger-Kernel PR #1298 (issue #968): the first release tag containing it
# liger_kernel/ops/cross_entropy.py: a kernel every Liger loss path defines at import
_PROBE_KERNEL = ("liger_kernel.ops.cross_entropy", "liger_cross_entropy_kernel")
_TRUE = {"1", "true", "yes", "on"}


def _from_liger(obj: Any) -> bool:
    return str(getattr(obj, "__module__", "") or "").startswith(LIGER)


def _function_of(method: Any) -> Any:
    return getattr(method, "__func__", method)


def liger_requested(args: Any) -> bool:
    """The TrainingArguments (or a TRL config) ask transformers to apply Liger at ``train()``."""
    return getattr(args, "use_liger_kernel", False) is True


def patched_modules(model: Any, limit: int = 10) -> list[str]:
    """Names of the modules whose forward Liger replaced (``""`` is the model itself), at most ``limit``."""
    if not isinstance(model, torch.nn.Module):
        return []
    found = []
    for name, module in model.named_modules():
        own = vars(module).get("forward")
        if _from_liger(type(module)) or _from_liger(_function_of(own)) or _from_liger(type(module).forward):
            found.append(name)
            if len(found) >= limit:
                break
    return found


def fused_loss_forward(module: Any) -> str | None:
    """Liger's fused-loss forward running as ``module.forward``, by its qualified name
    (``liger_kernel.transformers.model.llama.lce_forward``), or None."""
    forward = _function_of(vars(module).get("forward") if hasattr(module, "__dict__") else None)
    if forward is None:
        forward = getattr(type(module), "forward", None)
    if _from_liger(forward) and "lce_forward" in getattr(forward, "__name__", ""):
        return f"{forward.__module__}.{forward.__name__}"
    return None


def _env_interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in _TRUE


def _kernels_defined_compiled() -> bool:
    """Liger's kernels were already defined without the interpreter (setting it now changes nothing)."""
    module = sys.modules.get(_PROBE_KERNEL[0])
    kernel = getattr(module, _PROBE_KERNEL[1], None)
    return kernel is not None and type(kernel).__name__ != "InterpretedFunction"


@dataclass
class TritonState:
    installed: bool
    interpret: bool = False  # TRITON_INTERPRET is set and Liger's kernels (if defined) use it
    interpret_too_late: bool = False  # set, but after Liger's kernels were defined compiled
    active_drivers: list[str] = field(default_factory=list)
    error: str | None = None  # reading the backends failed: nothing is claimed

    @property
    def can_launch(self) -> bool | None:
        """True/False when known; None when Triton could not be asked."""
        if self.error is not None:
            return None
        return self.interpret or len(self.active_drivers) == 1

    def to_dict(self) -> dict[str, Any]:
        return {"triton_installed": self.installed, "triton_interpret": self.interpret,
                "interpret_set_too_late": self.interpret_too_late, "active_drivers": self.active_drivers,
                **({"error": self.error} if self.error else {})}


def triton_state() -> TritonState:
    """Whether a Triton kernel can launch in this process: an active driver, or the interpreter."""
    if importlib.util.find_spec("triton") is None:
        return TritonState(installed=False)
    too_late = _env_interpret() and _kernels_defined_compiled()
    state = TritonState(installed=True, interpret=_env_interpret() and not too_late, interpret_too_late=too_late)
    try:
        from triton.backends import backends  # local: triton is heavy and only read when Liger is in play

        state.active_drivers = sorted(name for name, backend in backends.items() if backend.driver.is_active())
    except Exception as exc:  # a broken Triton install: say nothing rather than guess
        state.error = f"{type(exc).__name__}: {exc}"
    return state


def reduction_none_losses(model: Any = None, trainer: Any = None) -> list[str]:
    """Where a ``LigerFusedLinearCrossEntropyLoss(reduction="none")`` is held: model modules, the
    trainer's attributes and its ``compute_loss_func``."""
    places: list[tuple[str, Any]] = []
    if isinstance(model, torch.nn.Module):
        places += [(f"model.{n}" if n else "model", m) for n, m in model.named_modules()]
    if trainer is not None and hasattr(trainer, "__dict__"):
        places += [(f"trainer.{k}", v) for k, v in vars(trainer).items() if k != "model"]
    return [where for where, obj in places
            if type(obj).__name__ == FLCE_CLASS and _from_liger(type(obj)) and getattr(obj, "reduction", None) == "none"]


def liger_version() -> Any:
    return parsed_version("liger-kernel")
