"""Mixture-of-experts routers and fused experts, read off a model's modules."""
from __future__ import annotations

import re
from collections.abc import Iterable

import torch

_ROUTER_CLASS_MARKS = ("Router", "TopK")  # MixtralTopKRouter, Qwen2MoeTopKRouter, ...


def router_module_names(modules: Iterable[tuple[str, torch.nn.Module]]) -> list[str]:
    """Modules whose class names a router, or the ``gate`` of a sparse MoE block (older releases: a Linear)."""
    classes = {name: type(m).__name__ for name, m in modules}
    return [name for name, cls in classes.items()
            if any(mark in cls for mark in _ROUTER_CLASS_MARKS)
            or (name.endswith(".gate") and "Moe" in classes.get(name.rsplit(".", 1)[0], ""))]


def trainable_router_params(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    routers = router_module_names(model.named_modules())
    return [(n, p) for n, p in model.named_parameters()
            if p.requires_grad and any(n.startswith(r + ".") for r in routers)]


# ---- fused experts: 3-D parameters that LoRA's target_modules cannot reach ----------------------
# Names users give target_modules for expert projections (Llama/Qwen style, Mixtral v4 style, fused).
EXPERT_TARGET_NAMES = frozenset({"gate_proj", "up_proj", "down_proj", "w1", "w2", "w3", "gate_up_proj", "experts"})
_LAYER_INDEX = re.compile(r"^(?:.*\.)?\d+\.")


def clean_param_name(name: str) -> str:
    """A parameter's name as the base model spells it: PEFT's ``base_model.model.`` and ``base_layer.`` dropped."""
    name = name.removeprefix("base_model.model.")
    return ".".join(part for part in name.split(".") if part != "base_layer")


def target_parameter_pattern(name: str) -> str:
    """What LoRA's ``target_parameters`` matches (a suffix): ``model.layers.3.mlp.experts.down_proj`` ->
    ``mlp.experts.down_proj``, the same in every layer."""
    name = clean_param_name(name)
    match = _LAYER_INDEX.match(name)
    return name[match.end():] if match else name


def _is_expert_container(path: str, module: torch.nn.Module) -> bool:
    if hasattr(module, "parameter_name"):  # a PEFT ParamWrapper: its base layer holds the parameters
        return False
    return "Expert" in type(module).__name__ or path.rsplit(".", 1)[-1] == "experts"


def fused_expert_params(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter, torch.nn.Module]]:
    """The experts held as one stacked (>= 3-D) floating parameter per projection (Mixtral, Qwen-MoE, OLMoE,
    gpt-oss under transformers v5: ``experts.gate_up_proj`` of shape (experts, 2 x intermediate, hidden)),
    as (full name, parameter, the module that owns it)."""
    found = []
    for path, module in model.named_modules():
        if not _is_expert_container(path, module):
            continue
        for leaf, p in module.named_parameters(recurse=False):
            if p.dim() >= 3 and p.is_floating_point():
                found.append((f"{path}.{leaf}" if path else leaf, p, module))
    return found


def adapted_parameters(model: torch.nn.Module) -> set[tuple[int, str]]:
    """(id of the module that owns the parameter, its name) for every parameter a PEFT ``ParamWrapper``
    (LoRA's ``target_parameters``) puts an adapter on."""
    adapted = set()
    for _, module in model.named_modules():
        name = getattr(module, "parameter_name", None)
        if not isinstance(name, str) or not hasattr(module, "lora_A"):
            continue
        base = module.base_layer
        while hasattr(base, "parameter_name") and hasattr(base, "base_layer"):
            base = base.base_layer
        adapted.add((id(base), name))
    return adapted


def frozen_unadapted_experts(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """Fused expert parameters that carry no adapter and do not train: fine-tuning leaves them as pre-trained."""
    adapted = adapted_parameters(model)
    return [(name, p) for name, p, owner in fused_expert_params(model)
            if not p.requires_grad and (id(owner), name.rsplit(".", 1)[-1]) not in adapted]


def names_experts(target_modules) -> list[str]:
    """The entries of a LoRA ``target_modules`` that name expert projections (``"all-linear"`` names them all:
    under transformers v4 the experts were Linear modules)."""
    if target_modules is None:
        return []
    if isinstance(target_modules, str):
        if target_modules.lower() == "all-linear":
            return [target_modules]
        return [target_modules] if any(n in target_modules for n in EXPERT_TARGET_NAMES) else []
    return sorted(t for t in target_modules if str(t).rsplit(".", 1)[-1] in EXPERT_TARGET_NAMES)


def targets_every_linear(model: torch.nn.Module, target_modules) -> bool:
    """Whether a list ``target_modules`` reaches every Linear but the output head: what PEFT writes back into the
    config once it resolved ``"all-linear"`` (full module names), so the user's "all-linear" can still be told."""
    if target_modules is None or isinstance(target_modules, str):
        return False
    targets = {str(t) for t in target_modules}
    if not targets or not all("." in t for t in targets):  # a user's own list names leaves (q_proj), not paths
        return False
    linears = {clean_param_name(name) for name, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and "lora_" not in name and not name.endswith("lm_head")
               and not name.endswith("lm_head.base_layer")}
    return bool(linears) and all(n in targets or n.rsplit(".", 1)[-1] in targets for n in linears)
