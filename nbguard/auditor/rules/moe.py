"""Mixture-of-experts routers trained without the load-balancing loss; fused experts LoRA never reaches.

Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE and their kin add ``router_aux_loss_coef * aux_loss`` to the
loss only when ``config.output_router_logits`` is True (False in most released configs). A router
whose weights train (full fine-tuning, or LoRA's ``modules_to_save=["gate"]``) without that term is
pulled toward the experts that already win: routing collapses onto a few experts and the others
stop learning. The rule reads the router parameters' ``requires_grad`` and the flag the forward uses.

Under transformers v5 the experts of these models are fused 3-D parameters (``experts.gate_up_proj``,
``experts.down_proj``), not ``nn.Linear`` modules. A LoRA ``target_modules`` that names ``gate_proj``/``up_proj``/
``down_proj`` or ``w1``/``w2``/``w3`` reaches them only where the installed PEFT maps those names to the fused
parameters (PEFT 0.21 does so for some model types and name sets only); elsewhere the experts get no adapter and
stay frozen (peft#3009). ``target_parameters`` (PEFT >= 0.17) puts LoRA on the parameters themselves.
"""
from __future__ import annotations

from ...introspect.moe import (
    clean_param_name,
    frozen_unadapted_experts,
    fused_expert_params,
    names_experts,
    router_module_names,
    target_parameter_pattern,
    targets_every_linear,
)
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


# PEFT release that added LoraConfig(target_parameters=...): LoRA on nn.Parameter, for fused MoE experts
TARGET_PARAMETERS_SINCE = "0.17.0"


def _lora_configs(model) -> list[tuple[str, object]]:
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, dict):
        return []
    return [(name, c) for name, c in configs.items() if hasattr(c, "target_modules")]


@rule("moe-experts-not-adapted", "warning")
def moe_experts_not_adapted(ctx):
    """LoRA target_modules names expert projections, but the experts are fused 3-D parameters: no adapter, frozen."""
    if not ctx.is_peft or ctx.model is None:
        return None
    configs = _lora_configs(ctx.model)
    named = sorted({n for _, c in configs for n in names_experts(c.target_modules)})
    if not named and any(targets_every_linear(ctx.model, c.target_modules) for _, c in configs):
        named = ["all-linear"]  # PEFT wrote the Linear modules it resolved "all-linear" to back into the config
    if not named:  # an adapter on attention only (q_proj, v_proj) is a choice, not this mistake
        return None
    frozen = frozen_unadapted_experts(ctx.model)
    if not frozen:
        return None
    names = [clean_param_name(n) for n, _ in frozen]
    elements = sum(p.numel() for _, p in frozen)
    patterns = sorted({target_parameter_pattern(n) for n in names})
    owners = sorted({type(owner).__name__ for n, _, owner in fused_expert_params(ctx.model)})
    supported = all(hasattr(c, "target_parameters") for _, c in configs)
    peft_version = ctx.version("peft")
    how = (f"Add target_parameters={patterns} to the LoraConfig (this PEFT has it) so LoRA wraps the expert "
           "parameters themselves." if supported else
           f"This PEFT ({peft_version}) has no LoraConfig.target_parameters: upgrade to PEFT >= "
           f"{TARGET_PARAMETERS_SINCE}, which adds it, then set target_parameters={patterns}.")
    return finding(
        "moe-experts-not-adapted",
        f"{len(frozen)} fused expert parameter(s) ({elements:,} elements) carry no LoRA adapter and stay frozen",
        f"target_modules names {named}, but this model holds its experts as fused 3-D parameters of "
        f"{', '.join(owners)} (one tensor of all experts per projection, e.g. {names[0]}), not as nn.Linear "
        f"modules, and PEFT {peft_version} attached no adapter to them (peft#3009): they are frozen, so the "
        "experts, most of an MoE's weights, keep their pre-trained values while the adapter trains only the rest. "
        + how,
        {"frozen_expert_params": capped(names), "frozen_expert_elements": elements, "expert_classes": owners,
         "target_modules_naming_experts": named, "target_parameters_to_add": patterns,
         "peft_version": str(peft_version) if peft_version is not None else None,
         "peft_has_target_parameters": supported},
        fixes=["lora-target-fused-experts"] if supported else [])
