"""Fixes for quantised layers other than bitsandbytes (torchao Float8)."""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .registry import Fix, register

LB = 1e-12  # the lower bound the torchao maintainers give in pytorch/ao#3356


def _unbounded_per_row(model: torch.nn.Module):
    """(name, weight, act_quant_kwargs) of torchao weights whose activations are scaled per row with no lower bound."""
    for name, module in model.named_modules():
        weight = module.__dict__.get("_parameters", {}).get("weight")
        act = getattr(weight, "act_quant_kwargs", None)
        if act is None or not type(weight).__module__.startswith("torchao"):
            continue
        if type(getattr(act, "granularity", None)).__name__ == "PerRow" and getattr(act, "hp_value_lb", 0) is None:
            yield name, weight, act


# ---- float8-activation-lb ---------------------------------------------------------------------
def _apply_lb(target, lb: float = LB, **_: Any) -> dict[str, str]:
    changed = {}
    for name, weight, act in list(_unbounded_per_row(target.model)):
        weight.act_quant_kwargs = dataclasses.replace(act, hp_value_lb=lb)
        changed[f"{name}.weight.act_quant_kwargs.hp_value_lb"] = f"None -> {lb:g}"
    return changed


def _lb_code(names, lb: float = LB, **_: Any) -> str:
    return f"""import dataclasses

# torchao scales each activation row by its own amax; an all-zero row (a padded position: the pad
# token's embedding row is zero) gets scale 0 and NaN. A lower bound on the amax keeps it finite:
# this sets on the quantised weights what quantising with
# Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(), activation_value_lb={lb:g})
# sets (use that config where you quantise the model, so a reload keeps it).
for _module in {names.model}.modules():
    _weight = _module.__dict__.get("_parameters", {{}}).get("weight")
    _act = getattr(_weight, "act_quant_kwargs", None)
    if _act is not None and type(_act.granularity).__name__ == "PerRow" and _act.hp_value_lb is None:
        _weight.act_quant_kwargs = dataclasses.replace(_act, hp_value_lb={lb:g})
"""


register(Fix("float8-activation-lb", "Bound torchao's per-row float8 activation scale (activation_value_lb)",
             "Give every torchao per-row float8 layer without one an activation amax lower bound of 1e-12 "
             "(activation_value_lb), so an all-zero activation row (padding) quantises to zeros instead of NaN.",
             _apply_lb, _lb_code))
