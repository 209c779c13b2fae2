"""Fixes that change a plain loop's optimizer (or the one a Trainer built)."""
from __future__ import annotations

from typing import Any

from ..introspect.dtypes import dtype_name
from ..introspect.optimizers import eps_underflows
from ..step.plan import CapturedStep, NotCheckable
from .registry import Fix, Names, Target, register


# ---- optimizer-eps-for-dtype -----------------------------------------------------------------
def _check_eps(eps: Any) -> float | None:
    if eps is None:
        return None
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise ValueError(f"eps must be a positive number such as 1e-4 (or None: the smallest power of ten the "
                         f"weights' dtype holds as a normal number); got {eps!r}")
    return float(eps)


def _eps_apply(target: Target, eps: float | None = None, **_: Any) -> dict[str, str]:
    wanted = _check_eps(eps)
    changed = {}
    for low in eps_underflows(target.optimizer):
        new = wanted if wanted is not None else low.safe_eps
        if new < low.smallest_normal:
            raise ValueError(f"eps={new!r} is still below the smallest normal {dtype_name(low.dtype)} "
                             f"({low.smallest_normal:.3g}); use at least {low.safe_eps!r}")
        target.optimizer.param_groups[low.group]["eps"] = new
        changed[f"param_groups[{low.group}].eps"] = f"{low.eps!r} -> {new!r}"
    return changed


def _eps_code(names: Names, eps: float | None = None, **_: Any) -> str:
    wanted = _check_eps(eps)
    opt = names.optimizer
    new = "10.0 ** math.ceil(math.log10(_tiny))  # float16: 1e-4" if wanted is None else repr(wanted)
    return f"""import math

import torch

# Adam divides by sqrt(second moment) + eps in the weights' dtype: in float16 an eps below 6.1e-05 (the
# smallest normal float16) is stored with few bits or none (1e-8 rounds to 0), so a second moment that
# underflowed to 0 divides by 0 and the weight becomes inf. Raise eps where the weights are half precision
# (keeping float32 weights under torch.autocast is the other way: upcast-trainable-fp32).
for _group in {opt}.param_groups:
    _half = [_p for _p in _group["params"] if _p.requires_grad and _p.dtype in (torch.float16, torch.bfloat16)]
    _tiny = max((torch.finfo(_p.dtype).tiny for _p in _half), default=0.0)
    if "betas" in _group and isinstance(_group.get("eps"), float) and _group["eps"] < _tiny:
        _group["eps"] = {new}
"""


def _eps_plan(step: CapturedStep, **_: Any) -> Any:
    raise NotCheckable("eps enters the optimizer's update, not the step's forward or backward; re-audit with the "
                       "optimizer (nbguard.audit(model, optimizer=...)) to see the finding go")


register(Fix("optimizer-eps-for-dtype", "Raise Adam's eps above the weights' smallest normal",
             "Set eps of each Adam-family param group whose half-precision weights cannot hold it (float16: "
             "eps < 6.1e-05) to the smallest power of ten they hold (1e-4 for float16).",
             _eps_apply, _eps_code, needs="optimizer", plan=_eps_plan, rank=25))
