"""Rules about Liger kernels: a run that asks for them where Triton cannot launch a kernel, and
Liger's fused loss configured in the mode whose gradients were wrong.

transformers applies Liger at the start of ``train()`` (``use_liger_kernel=True``), and its Triton
kernels need a GPU driver: on a machine without one the first forward raises "0 active drivers",
after the Trainer is built and the data loaded. Both rules read objects and the installed packages
only; neither runs a kernel.
"""
from __future__ import annotations

from typing import Any

from ...introspect.liger import (
    REDUCTION_NONE_FIXED,
    liger_requested,
    liger_version,
    patched_modules,
    reduction_none_losses,
    triton_state,
)
from ..registry import capped, finding, rule

FIXED_RELEASE = tuple(int(part) for part in REDUCTION_NONE_FIXED.split("."))


def _args(ctx) -> Any:
    return ctx.args if ctx.args is not None else getattr(ctx.trainer, "args", None)


def _model(ctx) -> Any:
    return ctx.model if ctx.model is not None else getattr(ctx.trainer, "model", None)


@rule("liger-no-triton-driver", "error")
def liger_without_driver(ctx):
    """Liger kernels requested (use_liger_kernel=True, or a model patched by apply_liger_kernel_to_*) where Triton has no active driver and TRITON_INTERPRET is not set: the first forward raises "0 active drivers"."""
    args = _args(ctx)
    requested = liger_requested(args)
    patched = patched_modules(_model(ctx))
    if not requested and not patched:
        return None
    if not patched and liger_version() is None:  # train() raises transformers' ImportError first, not this
        return None
    triton = triton_state()
    if triton.can_launch is not False:  # a driver, the interpreter, or Triton could not be asked
        return None
    how = []
    if requested:
        how.append(f"{type(args).__name__}(use_liger_kernel=True) makes transformers apply Liger's Triton kernels "
                   "to the model when train() starts")
    if patched:
        how.append(f"the model already runs Liger's kernels ({', '.join(repr(n or '<model>') for n in patched[:3])}"
                   f"{', ...' if len(patched) > 3 else ''})")
    missing = "Triton is not installed" if not triton.installed else "Triton has no active driver here (no GPU)"
    late = (" TRITON_INTERPRET is set, but only after Liger's kernels were defined: Triton reads it when a "
            "kernel is defined, so it must be set before liger_kernel is imported.") if triton.interpret_too_late else ""
    fix = ("set use_liger_kernel=False in the TrainingArguments/SFTConfig for this machine (the model trains the "
           "same without the fused kernels, with more memory)" if requested else
           "load the model again without apply_liger_kernel_to_* (Liger patched it in place)")
    return finding(
        "liger-no-triton-driver", "Liger kernels requested where Triton cannot run them: the first forward will crash",
        f"{'; '.join(how)}. {missing}, so the first kernel launch raises \"RuntimeError: 0 active drivers ([]). "
        f"There should only be one.\" inside the first forward.{late} Either {fix}, or run on a GPU machine "
        "(CUDA or ROCm), where Triton has its driver.",
        {"use_liger_kernel": requested, "patched_modules": capped(patched), **triton.to_dict()})


@rule("liger-fused-loss-reduction-none", "warning")
def fused_loss_reduction_none(ctx):
    """LigerFusedLinearCrossEntropyLoss(reduction='none') with liger-kernel before 0.8.2: its weight and bias gradients ignore the per-token weights applied to the loss (Liger-Kernel#968)."""
    places = reduction_none_losses(_model(ctx), ctx.trainer)
    version = liger_version()
    if not places or version is None or version.release >= FIXED_RELEASE:
        return None
    return finding(
        "liger-fused-loss-reduction-none", f"Liger's fused loss with reduction='none' computes wrong gradients in "
        f"liger-kernel {version}",
        f"{', '.join(places[:3])} is a LigerFusedLinearCrossEntropyLoss with reduction='none'. Before liger-kernel "
        f"{REDUCTION_NONE_FIXED} its backward multiplied every gradient by the first token's upstream gradient "
        "instead of each token's own (Liger-Kernel#968, fixed by PR #1298): per-token weights, masks or per-sample "
        "scaling applied to the returned losses are silently wrong in lm_head's and the hidden states' gradients, "
        "and a token masked out first can zero the whole gradient. Upgrade liger-kernel to "
        f"{REDUCTION_NONE_FIXED} or later, or use reduction='sum'/'mean' and weight the tokens through the labels "
        "(ignore_index) instead.",
        {"losses": capped(places), "liger_kernel": str(version), "fixed_in": REDUCTION_NONE_FIXED})
