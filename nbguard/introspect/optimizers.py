"""Facts read off a torch optimizer: Adam-family groups, their eps against the weights' dtype, fused/foreach.

Adam divides the first moment by ``sqrt(second moment) + eps``. The for-loop and foreach
implementations compute that denominator in the weights' dtype: with float16 weights an ``eps``
below float16's smallest normal (6.1e-05) is stored with few bits or not at all (1e-8 rounds to 0),
and a second moment that underflowed to 0 (a gradient below ~5e-3 squared and scaled by
``1 - beta2`` is under float16's smallest subnormal) divides by zero: the weight becomes inf. The
fused kernel computes in float32, so its eps never rounds to 0; its moments are still stored in
float16, so an underflowed second moment makes the update ``m / eps``, far too large.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from .dtypes import HALF_DTYPES, dtype_name, quantized_or_integer


def is_optimizer(obj: Any) -> bool:
    """A torch optimizer (or anything shaped like one: param_groups and step)."""
    return isinstance(obj, torch.optim.Optimizer) or (
        isinstance(getattr(obj, "param_groups", None), list) and callable(getattr(obj, "step", None)))


def adam_family(group: dict[str, Any]) -> bool:
    """An Adam-family group (Adam, AdamW, NAdam, RAdam, Adamax, bitsandbytes' Adam): betas and a float eps."""
    return "betas" in group and isinstance(group.get("eps"), float)


def smallest_normal(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).tiny)


def safe_eps(dtype: torch.dtype) -> float:
    """The smallest power of ten at or above ``dtype``'s smallest normal (float16: 1e-4)."""
    return float(10.0 ** math.ceil(math.log10(smallest_normal(dtype))))


def implementation(group: dict[str, Any]) -> str:
    """fused, foreach or for-loop, as torch resolves the group's flags (foreach by default on CUDA)."""
    if group.get("fused"):
        return "fused"
    foreach = group.get("foreach")
    if foreach is None:
        params = [p for p in group["params"] if isinstance(p, torch.Tensor)]
        foreach = bool(params) and all(p.device.type == "cuda" for p in params)
    return "foreach" if foreach else "for-loop"


@dataclass(frozen=True)
class EpsUnderflow:
    """One Adam-family param group whose eps is below its half-precision weights' smallest normal."""

    group: int
    eps: float
    dtype: torch.dtype
    implementation: str
    parameters: int  # trainable half-precision tensors in the group

    @property
    def smallest_normal(self) -> float:
        return smallest_normal(self.dtype)

    @property
    def dtype_name_text(self) -> str:
        return dtype_name(self.dtype)

    @property
    def eps_in_dtype(self) -> float:
        """eps as the weights' dtype stores it (float16: 1e-8 -> 0.0)."""
        return float(torch.tensor(self.eps, dtype=self.dtype))

    @property
    def safe_eps(self) -> float:
        return safe_eps(self.dtype)

    def to_dict(self) -> dict[str, Any]:
        return {"param_group": self.group, "eps": self.eps, "weight_dtype": dtype_name(self.dtype),
                "smallest_normal": self.smallest_normal, "eps_in_weight_dtype": self.eps_in_dtype,
                "implementation": self.implementation, "half_precision_parameters": self.parameters,
                "safe_eps": self.safe_eps}


def half_params(group: dict[str, Any]) -> list[torch.Tensor]:
    return [p for p in group["params"] if isinstance(p, torch.Tensor) and p.requires_grad
            and not quantized_or_integer(p) and p.dtype in HALF_DTYPES]


def eps_underflows(optimizer: Any) -> list[EpsUnderflow]:
    """Every Adam-family group whose eps is below the smallest normal of its half-precision weights' dtype."""
    found = []
    for index, group in enumerate(getattr(optimizer, "param_groups", None) or []):
        if not adam_family(group):
            continue
        half = half_params(group)
        if not half:
            continue
        dtype = max({p.dtype for p in half}, key=smallest_normal)  # float16 before bfloat16
        if group["eps"] < smallest_normal(dtype):
            found.append(EpsUnderflow(index, group["eps"], dtype, implementation(group),
                                      sum(1 for p in half if p.dtype == dtype)))
    return found


def rounded_away(optimizer: Any, sample: int = 4096) -> list[dict[str, Any]]:
    """Adam-family groups whose learning rate is below half the spacing (ulp) of most of their half-precision
    weights: Adam's per-element update is at most about lr, so ``w - lr * u`` rounds back to ``w``."""
    out = []
    for index, group in enumerate(getattr(optimizer, "param_groups", None) or []):
        lr = group.get("lr")
        if not adam_family(group) or not isinstance(lr, (int, float)) or lr <= 0:
            continue
        for dtype in HALF_DTYPES:
            params = [p for p in half_params(group) if p.dtype == dtype]
            if not params:
                continue
            with torch.no_grad():
                values = torch.cat([p.detach().reshape(-1)[:: max(1, p.numel() // sample)][:sample].float().abs()
                                    for p in params])
            values = values[values > 0]
            if values.numel() == 0:
                continue
            # the spacing of a float at |w|: 2^(floor(log2 |w|)) * finfo.eps (finite, normal values)
            spacing = torch.exp2(torch.floor(torch.log2(values))) * torch.finfo(dtype).eps
            lost = float((lr < spacing / 2).float().mean())
            if lost > 0.5:
                median = float(values.median())
                out.append({"param_group": index, "lr": float(lr), "weight_dtype": dtype_name(dtype),
                            "median_abs_weight": median,
                            "ulp_at_median": float(2.0 ** math.floor(math.log2(median)) * torch.finfo(dtype).eps),
                            "share_of_weights_unchanged": round(lost, 3), "parameters": len(params)})
    return out
