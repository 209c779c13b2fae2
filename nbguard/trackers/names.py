"""Dashboard names for module groups: short, stable across runs, and a bounded number of series."""
from __future__ import annotations

import math
import re

# wrappers that every group of a model shares (PEFT's, a causal LM's body): they only lengthen names
_WRAPPERS = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?")
MAX_NAME = 48
OTHER = "other"


def short_group(group: str) -> str:
    """``base_model.model.model.layers.3.self_attn`` -> ``layers.3.self_attn``: a pure function of
    the name, so the same model gives the same series in every run. Over ``MAX_NAME`` characters the
    middle is elided (the block number and the leaf stay readable)."""
    name = _WRAPPERS.sub("", group) or group
    if len(name) > MAX_NAME:
        keep = (MAX_NAME - 1) // 2
        name = f"{name[:keep]}…{name[-keep:]}"
    return name


def short_names(groups: list[str]) -> dict[str, str]:
    """group -> short name; a group whose short name collides with another's keeps its full name."""
    short = {g: short_group(g) for g in groups}
    taken: dict[str, int] = {}
    for name in short.values():
        taken[name] = taken.get(name, 0) + 1
    return {g: (s if taken[s] == 1 else g) for g, s in short.items()}


def fold(values: dict[str, float | None], cap: int, ratios: bool = False) -> dict[str, float]:
    """At most ``cap`` series: non-finite groups first, then the largest norms; the rest folded into
    ``other`` as the norm of their concatenation (sqrt of the sum of squares), so nothing is lost.
    ``ratios``: the values are ratios (update norms), which do not add: ``other`` is the largest of the rest."""
    if cap < 2:
        raise ValueError(f"max_series must be at least 2 (the largest group and '{OTHER}'), got {cap}")
    known = {g: v for g, v in values.items() if v is not None}
    if len(known) <= cap:
        return dict(known)
    ranked = sorted(known, key=lambda g: (math.isfinite(known[g]), -known[g] if math.isfinite(known[g]) else 0.0))
    kept = {g: known[g] for g in ranked[:cap - 1]}
    rest = [known[g] for g in ranked[cap - 1:]]
    kept[OTHER] = max(rest) if ratios else math.sqrt(sum(v ** 2 for v in rest))
    return kept
