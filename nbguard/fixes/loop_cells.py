"""The plain-loop side of the fixes that a Trainer takes through its arguments.

A plain PyTorch loop has no ``args`` and no ``trainer``: its cells act on the objects it has (its
optimizer, by the notebook's own name) and say which of its own lines (``torch.autocast``, the
GradScaler) to change where a cell cannot reach them. The action and the cell do the same thing, and
both are idempotent together: the clipping hook is kept on the optimizer under one attribute.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from .registry import Names

CLIP_HOOK = "_clip_hook"  # the optimizer's step pre-hook handle (the cell sets the same attribute)
CLIP_NORM = "_clip_max_norm"
_BASE_LRS = "_nbguard_base_lrs"  # each group's LR before the first lowering: keeps apply idempotent


def _optimizer(optimizer: Any, fix: str) -> Any:
    if optimizer is None or not callable(getattr(optimizer, "register_step_pre_hook", None)) \
            or not isinstance(getattr(optimizer, "param_groups", None), list):
        got = "nothing" if optimizer is None else type(optimizer).__name__
        raise ValueError(f"fix {fix!r} in a plain loop acts on its optimizer: pass optimizer= (a "
                         f"torch.optim.Optimizer), or trainer=/args= for a Trainer; got {got}")
    return optimizer


def _check_max_norm(max_norm: Any) -> float:
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm > 0:
        raise ValueError(f"max_norm must be a positive number such as 1.0; got {max_norm!r}")
    return float(max_norm)


def loop_clip(optimizer: Any, max_norm: float = 1.0) -> dict[str, str]:
    optimizer = _optimizer(optimizer, "enable-grad-clipping")
    max_norm = _check_max_norm(max_norm)
    old = getattr(optimizer, CLIP_NORM, None)
    if old == max_norm and getattr(optimizer, CLIP_HOOK, None) is not None:
        return {}

    def clip_before_step(opt: Any, args: Any, kwargs: Any) -> None:
        params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
        torch.nn.utils.clip_grad_norm_(params, max_norm)

    hook = getattr(optimizer, CLIP_HOOK, None)
    if hook is not None:
        hook.remove()
    setattr(optimizer, CLIP_HOOK, optimizer.register_step_pre_hook(clip_before_step))
    setattr(optimizer, CLIP_NORM, max_norm)
    return {"optimizer": f"clips the gradient norm to {max_norm!r} before every step (was {old!r})"}


def loop_clip_code(names: Names, max_norm: float = 1.0) -> str:
    opt = names.optimizer or "optimizer"
    max_norm = _check_max_norm(max_norm)
    return f"""import torch

# Clip the total gradient norm to {max_norm!r} before every {opt}.step(): one outlier gradient can no longer blow
# the weights up. In your loop the same line is
#   torch.nn.utils.clip_grad_norm_({names.model}.parameters(), {max_norm!r})
# after backward (after scaler.unscale_({opt}) under a GradScaler) and before the step.
def _clip_before_step(_optimizer, _args, _kwargs):
    _params = [_p for _g in _optimizer.param_groups for _p in _g["params"] if _p.grad is not None]
    torch.nn.utils.clip_grad_norm_(_params, {max_norm!r})


if getattr({opt}, "{CLIP_HOOK}", None) is not None:
    {opt}.{CLIP_HOOK}.remove()
{opt}.{CLIP_HOOK} = {opt}.register_step_pre_hook(_clip_before_step)
{opt}.{CLIP_NORM} = {max_norm!r}
"""


def loop_lower_lr(optimizer: Any, factor: float) -> dict[str, str]:
    optimizer = _optimizer(optimizer, "lower-learning-rate")
    bases = getattr(optimizer, _BASE_LRS, None) or [g["lr"] for g in optimizer.param_groups]
    changed = {}
    for index, (group, base) in enumerate(zip(optimizer.param_groups, bases)):
        wanted = base * factor
        if math.isclose(group["lr"], wanted, rel_tol=1e-9):
            continue
        scale = wanted / group["lr"]
        changed[f"param_groups[{index}].lr"] = f"{group['lr']:g} -> {wanted:g}"
        group["lr"] = wanted
        if "initial_lr" in group:  # an LR scheduler's starting point
            group["initial_lr"] *= scale
    setattr(optimizer, _BASE_LRS, bases)
    return changed


def loop_lower_lr_code(names: Names, factor: float) -> str:
    opt = names.optimizer or "optimizer"
    return f"""# A smaller learning rate: the updates that overflowed (or diverged) shrink by {factor!r}x.
_factor = {factor!r}
for _group in {opt}.param_groups:
    _group["lr"] *= _factor
    if "initial_lr" in _group:  # an LR scheduler built on {opt} starts from here
        _group["initial_lr"] *= _factor
# An LR scheduler keeps its own base_lrs: scale them too, e.g.
#   scheduler.base_lrs = [_lr * _factor for _lr in scheduler.base_lrs]
"""


def loop_precision_code(names: Names, to: str) -> str:
    """What switch-precision's cell adds for a plain loop: the optimizer's moments follow the weights, and
    the loop's own autocast / GradScaler lines, which no cell can rewrite, are named."""
    opt = names.optimizer
    scaler = f"{names.scaler} = torch.amp.GradScaler(enabled=False)" if names.scaler else \
        "a GradScaler, if your loop has one, can be GradScaler(enabled=False)"
    code = ""
    if opt:
        code += f"""
# {opt} may have stepped already: its moments follow their weights' new dtype.
for _param, _state in {opt}.state.items():
    for _key, _value in _state.items():
        if torch.is_tensor(_value) and _value.is_floating_point() and _key != "step":
            _state[_key] = _value.to(_param.dtype)
"""
    if to == "bf16":
        code += f"""
# In your loop: torch.autocast(device_type, dtype=torch.bfloat16) instead of dtype=torch.float16. bf16 has
# fp32's range, so no loss scaling is needed: {scaler} (its calls stay valid).
"""
    else:
        code += f"""
# In your loop: no torch.autocast around the forward (or torch.autocast(device_type, enabled=False)); everything
# computes in float32, and {scaler}.
"""
    return code
