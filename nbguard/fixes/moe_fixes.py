"""Fixes for MoE adapters: LoRA on fused expert parameters (``target_parameters``)."""
from __future__ import annotations

from typing import Any

from ..introspect.moe import frozen_unadapted_experts, target_parameter_pattern
from ..step.plan import CapturedStep, NotCheckable
from .registry import Fix, Names, Target, register


# ---- lora-target-fused-experts ----------------------------------------------------------------
def _expert_patterns(model: Any) -> list[str]:
    return sorted({target_parameter_pattern(name) for name, _ in frozen_unadapted_experts(model)})


def _target_experts(target: Target, patterns: list[str] | None = None, **_: Any) -> dict:
    model = target.model
    if not frozen_unadapted_experts(model):
        return {}
    patterns = sorted(patterns) if patterns else _expert_patterns(model)
    if not patterns:
        return {}
    tuner: Any = getattr(model, "base_model", None)
    adapter = getattr(model, "active_adapter", None)
    configs = getattr(model, "peft_config", None)
    if not callable(getattr(tuner, "inject_adapter", None)) or not isinstance(configs, dict) or adapter not in configs:
        raise ValueError("lora-target-fused-experts needs the PeftModel that get_peft_model returned; "
                         f"{type(model).__name__} has no LoRA tuner to add target_parameters to")
    config = configs[adapter]
    if not hasattr(config, "target_parameters"):
        raise ValueError("this PEFT has no LoraConfig.target_parameters (added in PEFT 0.17.0): upgrade PEFT")
    before = sorted(config.target_parameters or [])
    trains = {id(p): p.requires_grad for p in model.parameters()}
    modules = config.target_modules
    # Inject only the new parameter adapters: the adapters already on target_modules keep their weights.
    config.target_modules, config.target_parameters = set(), patterns
    try:
        tuner.inject_adapter(tuner.model, adapter)
    finally:
        config.target_modules = modules
        config.target_parameters = sorted(set(before) | set(patterns))
    for p in model.parameters():  # injecting marks only adapters trainable: keep what trained before
        if id(p) in trains:
            p.requires_grad_(trains[id(p)])
    left = frozen_unadapted_experts(model)
    if left:
        raise RuntimeError(f"target_parameters={patterns} left {len(left)} expert parameter(s) without an adapter")
    return {"target_parameters": f"{before} -> {config.target_parameters}",
            "note": "new adapter parameters: build the optimizer (or the Trainer) after this"}


def _target_experts_code(names: Names, patterns: list[str] | None = None, **_: Any) -> str:
    m = names.model
    listed = repr(patterns) if patterns else "_experts"
    find = "" if patterns else f"""_experts = sorted({{name.split(".base_layer")[0].split("layers.")[-1].split(".", 1)[-1]
                   for name, p in {m}.named_parameters()
                   if p.dim() >= 3 and "experts" in name and not p.requires_grad}})
"""
    return f"""# The MoE experts are fused 3-D parameters, not nn.Linear modules: target_modules cannot put LoRA on them.
# LoraConfig(target_parameters=...) (PEFT >= 0.17) can. In the cell that builds the adapter this is
#     LoraConfig(..., target_parameters={patterns or ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]!r})
# Here, on the live model (the existing adapters keep their weights); build the optimizer / Trainer after it.
{find}_config = {m}.peft_config[{m}.active_adapter]
_trains = {{id(p): p.requires_grad for p in {m}.parameters()}}
_modules, _before = _config.target_modules, list(_config.target_parameters or [])
_config.target_modules, _config.target_parameters = set(), {listed}
{m}.base_model.inject_adapter({m}.base_model.model, {m}.active_adapter)
_config.target_modules, _config.target_parameters = _modules, sorted(set(_before) | set({listed}))
for _p in {m}.parameters():
    if id(_p) in _trains:
        _p.requires_grad_(_trains[id(_p)])
"""


def _target_experts_plan(step: CapturedStep, **_: Any) -> Any:
    raise NotCheckable("it adds adapter modules to the model, and a shadow step runs only the modules the model "
                       "already has; applied, a training step gives the experts' LoRA weights a gradient "
                       "(tests/test_moe_experts.py)")


register(Fix("lora-target-fused-experts", "Put LoRA on the fused MoE experts (target_parameters)",
             "Add the fused expert parameters (experts.gate_up_proj, experts.down_proj) to the LoRA adapter's "
             "target_parameters, so the experts train instead of staying frozen.",
             _target_experts, _target_experts_code, plan=_target_experts_plan))
