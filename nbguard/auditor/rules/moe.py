"""Mixture-of-experts routers trained without the load-balancing loss.

Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE and their kin add ``router_aux_loss_coef * aux_loss`` to the
loss only when ``config.output_router_logits`` is True (False in most released configs). A router
whose weights train (full fine-tuning, or LoRA's ``modules_to_save=["gate"]``) without that term is
pulled toward the experts that already win: routing collapses onto a few experts and the others
stop learning. The rule reads the router parameters' ``requires_grad`` and the flag the forward uses.
"""
from __future__ import annotations

from ...introspect.moe import router_module_names
from ..registry import capped, finding, rule


def is_moe(ctx) -> bool:
    return any((getattr(c, "num_local_experts", None) or getattr(c, "num_experts", None) or 0) > 1
               for c in ctx.configs)


@rule("moe-router-without-aux-loss", "warning")
def moe_router_without_aux_loss(ctx):
    """Trainable MoE router weights while output_router_logits is off: no load-balancing loss, routing can collapse."""
    if not is_moe(ctx):
        return None
    routers = router_module_names(ctx.modules)
    trainable = [n for n, _ in ctx.trainable if any(n.startswith(r + ".") for r in routers)]
    if not trainable or any(getattr(c, "output_router_logits", False) for c in ctx.configs):
        return None
    coef = next((getattr(c, "router_aux_loss_coef", None) for c in ctx.configs
                 if getattr(c, "router_aux_loss_coef", None) is not None), None)
    return finding(
        "moe-router-without-aux-loss", f"{len(trainable)} router parameter(s) train without the load-balancing loss",
        f"The MoE routers train{' (under LoRA: modules_to_save or a target that matches the router)' if ctx.is_peft else ''}"
        f", but config.output_router_logits is False, so the forward never adds router_aux_loss_coef ({coef}) x the "
        "load-balancing loss. Trained on the language-model loss alone, routing drifts onto the experts that already "
        "win and the rest stop learning. Set model.config.output_router_logits = True, or freeze the routers "
        "(keep them out of LoRA's modules_to_save).",
        {"trainable_router_params": capped(trainable), "output_router_logits": False, "router_aux_loss_coef": coef,
         "peft": ctx.is_peft},
        fixes=["enable-router-aux-loss", "freeze-moe-router"])
