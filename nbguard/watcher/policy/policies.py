"""Guard policies: what happens to a bad update."""
from __future__ import annotations

import torch

from ...findings import Event
from ..core.pipeline import Detector

POLICIES = ("warn", "skip", "stop", "rewind")  # rewind: see .rewind


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


def update_dropper(policy: str, found: list[tuple[Detector, Event]], across_ranks: bool) -> Event | None:
    """Before the optimizer moves: the event whose update the policy drops (skip, stop and rewind), if any.

    The first event ``before_update`` returned whose detector asks for the drop. Across ranks only
    an ``agreed`` detector's events count: every rank must apply the same update."""
    if policy == "warn":
        return None
    return next((e for d, e in found if _acts(d, "drops_update", e, across_ranks)), None)


def training_stopper(policy: str, found: list[tuple[Detector, Event]], across_ranks: bool) -> Event | None:
    """After a step ended: the event that ends training under stop, if any (same rule across ranks)."""
    if policy != "stop":
        return None
    return next((e for d, e in found if _acts(d, "stops_training", e, across_ranks)), None)


def _acts(detector: Detector, question: str, event: Event, across_ranks: bool) -> bool:
    """``detector.<question>(event)``; False for a duck-typed detector without it, and across ranks
    for a detector whose events are not agreed."""
    if across_ranks and not getattr(detector, "agreed", False):
        return False
    asks = getattr(detector, question, None)
    return bool(asks(event)) if asks is not None else False
