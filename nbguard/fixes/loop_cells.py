"""The plain-loop side of the fixes that a Trainer takes through its arguments.

A plain PyTorch loop has no ``args`` and no ``trainer``: its cells act on the objects it has (its
optimizer, by the notebook's own name) and say which of its own lines (``torch.autocast``, the
GradScaler) to change where a cell cannot reach them. Each action is written once: apply calls the
function (``install_clip``, ``scale_lr``, ``follow_weight_dtypes``) and the cell carries its source, so
the two cannot drift apart; the clipping hook is kept on the optimizer under one attribute, which makes
them idempotent together.
"""
from __future__ import annotations

import functools
import inspect
import math
from typing import Any

import torch

from .registry import Names

CLIP_HOOK = "_clip_hook"  # the optimizer's step pre-hook handle (install_clip sets it, in apply and in the cell)
CLIP_NORM = "_clip_max_norm"
_BASE_LRS = "_nbguard_base_lrs"  # each group's LR before the first lowering: keeps apply idempotent


# ---- one definition each: apply calls these, the cells carry their source -----------------------
# Their source goes into the cells as it is: plain torch, no annotations, no names from nbguard.
def clip_before_step(optimizer, args, kwargs, max_norm=1.0):
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    torch.nn.utils.clip_grad_norm_(params, max_norm)


def install_clip(optimizer, max_norm):
    """Clip before every optimizer.step(), replacing a clip installed before (running it twice adds no hook)."""
    if getattr(optimizer, "_clip_hook", None) is not None:
        optimizer._clip_hook.remove()
    optimizer._clip_hook = optimizer.register_step_pre_hook(functools.partial(clip_before_step, max_norm=max_norm))
    optimizer._clip_max_norm = max_norm


def scale_lr(group, scale):
    """One param group's learning rate times ``scale``, and an LR scheduler's starting point with it."""
    group["lr"] *= scale
    if "initial_lr" in group:
        group["initial_lr"] *= scale


def follow_weight_dtypes(optimizer):
    """An optimizer that already stepped keeps its moments in the old dtype: each follows its weight's."""
    moved = 0
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if torch.is_tensor(value) and value.is_floating_point() and key != "step" and value.dtype != param.dtype:
                state[key] = value.to(param.dtype)
                moved += 1
    return moved


def half_inputs_to_float32(module, positional, keywords):
    """A forward pre-hook: outside torch.autocast, float16/bfloat16 tensors given to the model become float32,
    the dtype its weights have after a precision fix (a loop that feeds x.half() would stop at the first matmul
    with "mat1 and mat2 must have the same dtype"). Under autocast it changes nothing: autocast casts."""
    def cast(x):
        if torch.is_tensor(x) and x.dtype in (torch.float16, torch.bfloat16) \
                and not torch.is_autocast_enabled(x.device.type):
            return x.float()
        return x
    return tuple(cast(a) for a in positional), {k: cast(v) for k, v in keywords.items()}


def install_input_cast(module):
    """Cast the module's half-precision inputs before every forward (running it twice adds no hook)."""
    if getattr(module, "_input_cast_hook", None) is not None:
        return False
    module._input_cast_hook = module.register_forward_pre_hook(half_inputs_to_float32, with_kwargs=True)
    return True


def source(*functions: Any) -> str:
    """The functions' own source, for a cell that calls them."""
    return "\n\n".join(inspect.getsource(f) for f in functions)


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
    install_clip(optimizer, max_norm)
    return {"optimizer": f"clips the gradient norm to {max_norm!r} before every step (was {old!r})"}


def loop_clip_code(names: Names, max_norm: float = 1.0) -> str:
    opt = names.optimizer or "optimizer"
    max_norm = _check_max_norm(max_norm)
    return f"""import functools

import torch

# Clip the total gradient norm to {max_norm!r} before every {opt}.step(): one outlier gradient can no longer blow
# the weights up. In your loop the same line is
#   torch.nn.utils.clip_grad_norm_({names.model}.parameters(), {max_norm!r})
# after backward (after scaler.unscale_({opt}) under a GradScaler) and before the step.
{source(clip_before_step, install_clip)}

install_clip({opt}, {max_norm!r})
"""


def loop_lower_lr(optimizer: Any, factor: float) -> dict[str, str]:
    optimizer = _optimizer(optimizer, "lower-learning-rate")
    bases = getattr(optimizer, _BASE_LRS, None) or [g["lr"] for g in optimizer.param_groups]
    changed = {}
    for index, (group, base) in enumerate(zip(optimizer.param_groups, bases)):
        wanted = base * factor
        if math.isclose(group["lr"], wanted, rel_tol=1e-9):
            continue
        changed[f"param_groups[{index}].lr"] = f"{group['lr']:g} -> {wanted:g}"
        scale_lr(group, wanted / group["lr"])
    setattr(optimizer, _BASE_LRS, bases)
    return changed


def loop_lower_lr_code(names: Names, factor: float) -> str:
    opt = names.optimizer or "optimizer"
    return f"""# A smaller learning rate: the updates that overflowed (or diverged) shrink by {factor!r}x.
{source(scale_lr)}

_factor = {factor!r}
for _group in {opt}.param_groups:
    scale_lr(_group, _factor)
# An LR scheduler keeps its own base_lrs: scale them too, e.g.
#   scheduler.base_lrs = [_lr * _factor for _lr in scheduler.base_lrs]
"""


def loop_inputs_apply(model: Any, changed: dict[str, Any]) -> None:
    """A plain loop whose weights a fix moved to float32: its half inputs are cast before each forward (the
    loop's own ``x.half()`` stays as it is)."""
    if install_input_cast(model):
        changed["inputs"] = "float16/bfloat16 inputs become float32 before each forward outside autocast"


def loop_inputs_code(model: str) -> str:
    """The cell's part of ``loop_inputs_apply``, run when the cell cast a weight (``_cast``)."""
    return f"""
# Your loop feeds the model half-precision tensors (x.half(), x.to(torch.float16)) and its weights are float32
# now: they are cast to float32 before each forward (under torch.autocast nothing changes: autocast casts).
{source(half_inputs_to_float32, install_input_cast)}

if _cast:
    install_input_cast({model})
"""


def loop_optimizer_code(optimizer: str) -> str:
    """A loop's optimizer after its weights moved: the moments follow (``follow_weight_dtypes``)."""
    return f"""
# {optimizer}.state holds the moments of the steps taken already: they follow their weights' new dtype (and
# Adam's eps=1e-8, which is 0 in float16, is a normal float32 number).
{source(follow_weight_dtypes)}

follow_weight_dtypes({optimizer})
"""


def input_cast_batch(autocast: list) -> Any:
    """The shadow step's view of ``install_input_cast``: its hook's cast on each micro-batch, where the step runs
    without autocast (under autocast the hook changes nothing); None when it would change nothing."""
    if autocast:
        return None
    return functools.partial(half_inputs_to_float32, None)


def loop_precision_code(names: Names, to: str) -> str:
    """What switch-precision's cell adds for a plain loop: the optimizer's moments follow the weights, and
    the loop's own autocast / GradScaler lines, which no cell can rewrite, are named."""
    opt = names.optimizer
    scaler = f"{names.scaler} = torch.amp.GradScaler(enabled=False)" if names.scaler else \
        "a GradScaler, if your loop has one, can be GradScaler(enabled=False)"
    code = loop_inputs_code(names.model) + (loop_optimizer_code(opt) if opt else "")
    if to == "bf16":
        code += f"""
# If your loop runs under torch.autocast: torch.autocast(device_type, dtype=torch.bfloat16) instead of
# dtype=torch.float16. bf16 has fp32's range, so no loss scaling is needed: {scaler} (its calls stay valid).
"""
    else:
        code += f"""
# In your loop: no torch.autocast around the forward (or torch.autocast(device_type, enabled=False)); everything
# computes in float32, and {scaler}.
"""
    return code
