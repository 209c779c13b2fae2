"""Rules about the optimisation settings in TrainingArguments and the optimizer."""
from __future__ import annotations

import torch

from ...introspect.dtypes import dtype_name
from ..registry import capped, finding, rule

FP16_SMALLEST_SUBNORMAL = 2.0 ** -24  # about 5.96e-8: anything smaller is 0 in float16


@rule("no-grad-clipping", "warning")
def no_grad_clipping(ctx):
    """fp16 training without gradient clipping."""
    if ctx.args is None or not ctx.uses_fp16:
        return None
    norm = getattr(ctx.args, "max_grad_norm", None)
    if norm is not None and norm > 0:
        return None
    return finding(
        "no-grad-clipping",
        "fp16 training without gradient clipping",
        "max_grad_norm is off, so one large gradient (common in the first steps of fp16 training, or on an "
        "outlier batch) moves the weights by an unbounded step and the loss can jump to inf/NaN. Clip the "
        "total gradient norm to 1.0.",
        {"max_grad_norm": norm, "uses_fp16": True},
        fixes=["enable-grad-clipping"],
    )


@rule("optimizer-eps-underflow", "warning")
def optimizer_eps_underflow(ctx):
    """AdamW's eps is smaller than fp16 can represent while the trained weights (so optimizer states) are fp16."""
    eps = ctx.optimizer_eps
    fp16 = [(n, p) for n, p in ctx.trainable if p.dtype == torch.float16]
    if eps is None or not fp16 or eps >= FP16_SMALLEST_SUBNORMAL:
        return None
    return finding(
        "optimizer-eps-underflow",
        f"optimizer eps={eps:g} is 0 in float16",
        f"The trainable weights are float16, so Adam's moment estimates are float16 too, and eps={eps:g} is "
        f"below the smallest float16 value ({FP16_SMALLEST_SUBNORMAL:.3g}): it rounds to 0. Once the second "
        "moment underflows to 0 the update divides by zero and the weights become inf/NaN. Keep trainable "
        "weights in float32.",
        {"eps": eps, "fp16_smallest": FP16_SMALLEST_SUBNORMAL,
         "parameters": capped([f"{n}: {dtype_name(p.dtype)}" for n, p in fp16])},
        fixes=["upcast-trainable-fp32"],
    )


@rule("nan-filtered-logging", "info")
def nan_filtered_logging(ctx):
    """logging_nan_inf_filter hides NaN/inf losses from the logs."""
    if ctx.args is None or not getattr(ctx.args, "logging_nan_inf_filter", False):
        return None
    return finding(
        "nan-filtered-logging",
        "NaN and inf losses are filtered out of the logged loss",
        "With logging_nan_inf_filter=True (the default) the Trainer replaces a NaN or inf step loss by the "
        "average of the previous steps before logging, and evaluation drops non-finite batch losses before "
        "averaging eval_loss, so a run that has gone non-finite can still log plausible losses. Watch the run "
        "with nbguard.watch, or set logging_nan_inf_filter=False to see them.",
        {"logging_nan_inf_filter": True},
    )
