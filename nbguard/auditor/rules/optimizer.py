"""Rules about the optimizer a plain loop (or a built Trainer) steps: Adam's eps and update size against
half-precision weights. They read ``nbguard.audit(model, optimizer=...)`` / ``%precision_check model opt``."""
from __future__ import annotations

from ...document.view import plural
from ...introspect.optimizers import eps_underflows, rounded_away
from ..context import AuditContext
from ..registry import capped, finding, rule


@rule("adam-eps-underflow", "error")
def adam_eps_underflow(ctx: AuditContext):
    """Half-precision weights under an Adam-family optimizer whose eps is below the dtype's smallest normal."""
    low = eps_underflows(ctx.optimizer) if ctx.optimizer is not None else []
    if not low:
        return None
    worst = low[0]
    fused = all(g.implementation == "fused" for g in low)
    if fused:
        how = ("The fused kernel computes the update in float32, so eps does not round to 0 there, but the moments "
               "are stored in {dt}: a second moment that underflows to 0 makes the update m / eps, up to 1/eps "
               "times the learning rate.")
    else:
        how = ("The {impl} update computes sqrt(second moment) + eps in {dt}, where eps={eps!r} is stored as "
               "{stored!r}. A gradient below about 5e-3 gives a second moment that underflows to 0 in {dt} (its "
               "square times 1 - beta2 is below the smallest subnormal) while the first moment stays nonzero: "
               "the update divides by {stored!r} and the weight becomes inf, usually at the first step.")
    detail = (f"The optimizer's {plural(len(low), 'param group')} with {worst.dtype_name_text} trainable weights "
              f"{'uses' if len(low) == 1 else 'use'} eps={worst.eps!r}, below the smallest normal "
              f"{worst.dtype_name_text} ({worst.smallest_normal:.3g}). "
              + how.format(impl=worst.implementation, dt=worst.dtype_name_text, eps=worst.eps,
                           stored=worst.eps_in_dtype)
              + f" Raise eps to {worst.safe_eps!r} (optimizer-eps-for-dtype), or keep the trainable weights in "
              "float32 and let torch.autocast run the matmuls in half precision (upcast-trainable-fp32).")
    evidence = {**worst.to_dict(), "groups": [g.to_dict() for g in low],
                "optimizer": type(ctx.optimizer).__name__}
    return finding("adam-eps-underflow",
                   f"Adam's eps={worst.eps!r} is {worst.eps_in_dtype!r} in {worst.dtype_name_text}: "
                   + ("updates blow up" if fused else "the weights will become inf"),
                   detail, evidence, fixes=["optimizer-eps-for-dtype", "upcast-trainable-fp32"],
                   severity="warning" if fused else None)


@rule("half-updates-round-away", "warning")
def half_updates_round_away(ctx: AuditContext):
    """Adam's updates (about lr per weight) are below half the spacing of most half-precision weights."""
    groups = rounded_away(ctx.optimizer) if ctx.optimizer is not None else []
    if not groups:
        return None
    g = groups[0]
    return finding(
        "half-updates-round-away",
        f"lr={g['lr']:g} is below the {g['weight_dtype']} spacing of {g['share_of_weights_unchanged']:.0%} of "
        "the trainable weights: their updates round away",
        f"Adam moves each weight by about lr per step at most. A {g['weight_dtype']} weight of "
        f"{g['median_abs_weight']:.3g} (the median) is stored with spacing {g['ulp_at_median']:.3g}, so a step "
        f"of {g['lr']:g} rounds back to the same weight: {g['share_of_weights_unchanged']:.0%} of the sampled "
        "weights cannot move at this learning rate and stop learning without any error. Keep the trainable "
        "weights in float32 (fp32 master weights) and let torch.autocast run the matmuls in half precision.",
        {**g, "groups": capped(groups), "optimizer": type(ctx.optimizer).__name__},
        fixes=["upcast-trainable-fp32"])
