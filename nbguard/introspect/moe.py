"""Mixture-of-experts routers, read off a model's modules."""
from __future__ import annotations

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
