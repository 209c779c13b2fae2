"""Guard policies: what happens to a bad update."""
from __future__ import annotations

import torch

POLICIES = ("warn", "skip", "stop")


def check_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise ValueError(f"policy={policy!r} is not a nbguard watch policy; use one of {', '.join(POLICIES)}")
    return policy


def drop_update(optimizer: torch.optim.Optimizer | None, model: torch.nn.Module | None) -> int:
    """Set every gradient to None so the optimizer step moves nothing.

    Zeroed gradients are not enough: AdamW would still advance its moments and step count and
    apply weight decay. With ``grad=None`` the parameter is left out of the step entirely.
    """
    dropped = 0
    seen = set()
    groups = optimizer.param_groups if optimizer is not None else []
    params = [p for g in groups for p in g["params"]] + (list(model.parameters()) if model is not None else [])
    for p in params:
        if id(p) in seen:
            continue
        seen.add(id(p))
        if p.grad is not None:
            p.grad = None
            dropped += 1
    return dropped
