"""Small helpers over nested outputs: find the tensors, tell whether they are finite."""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def iter_tensors(obj: Any, path: str = "", _depth: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """(path, tensor) for every tensor a model output can carry: a tensor, tuples and named
    tuples, lists, dicts and ModelOutputs, dataclasses, and plain objects carrying a ``.loss``.

    Paths are stable for one output structure, so a gradient recorded at a path in the real
    backward finds its tensor again in the replay.
    """
    if _depth > 8:  # outputs are shallow; a deeper structure is something else (a cache, a graph)
        return
    if isinstance(obj, torch.Tensor):
        yield path or "output", obj
    elif isinstance(obj, dict):  # ModelOutput is an OrderedDict
        for key, value in obj.items():
            yield from iter_tensors(value, _join(path, str(key)), _depth + 1)
    elif isinstance(obj, (tuple, list)):  # named tuples included: by position
        for i, value in enumerate(obj):
            yield from iter_tensors(value, f"{path}[{i}]", _depth + 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from iter_tensors(getattr(obj, f.name, None), _join(path, f.name), _depth + 1)
    elif isinstance(getattr(obj, "loss", None), torch.Tensor) and not isinstance(obj, torch.nn.Module):
        for key, value in vars(obj).items() if hasattr(obj, "__dict__") else [("loss", obj.loss)]:
            if not key.startswith("_"):
                yield from iter_tensors(value, _join(path, key), _depth + 1)


def float_tensors(obj: Any, path: str = "", skip_masks: bool = True) -> list[tuple[str, torch.Tensor]]:
    """The floating-point tensors of ``obj``; attention masks may hold -inf by design, so skip them."""
    found = []
    for name, t in iter_tensors(obj, path):
        if not t.is_floating_point() or t.numel() == 0:
            continue
        if skip_masks and "mask" in name.lower():
            continue
        found.append((name, t))
    return found


@dataclass
class Summary:
    """Finiteness of a set of tensors (computed on the replay path only: it syncs)."""

    finite: bool = True
    absmax: float | None = None  # None: there was no floating tensor to measure
    first_bad: str | None = None
    has_inf: bool = False
    dtype: str | None = None

    @property
    def cause(self) -> str:
        return "overflow" if self.has_inf else "invalid-op"


def summarize(named: list[tuple[str, torch.Tensor]]) -> Summary:
    """Abs-max reports inf when any value overflowed, NaN when NaN is all that is wrong."""
    s = Summary()
    for name, t in named:
        t = t.detach()
        if s.dtype is None:
            s.dtype = str(t.dtype).replace("torch.", "")
        finite = bool(torch.isfinite(t).all())
        if finite:
            amax = float(t.abs().max())
        else:
            has_inf = bool(torch.isinf(t).any())
            amax = math.inf if has_inf else math.nan
            if s.finite:
                s.finite, s.first_bad, s.has_inf = False, name, has_inf
                s.dtype = str(t.dtype).replace("torch.", "")
        if s.absmax is None or math.isnan(amax) or (not math.isnan(s.absmax) and amax > s.absmax):
            s.absmax = s.absmax if (s.absmax is not None and math.isnan(amax) and math.isinf(s.absmax)) else amax
    return s


def nonfinite_params(module: torch.nn.Module) -> dict[str, int]:
    """Direct (not inherited) parameters of ``module`` holding NaN/Inf, with the count of bad values."""
    bad = {}
    for name, p in module.named_parameters(recurse=False):
        if p.is_floating_point():
            n = _nonfinite_count(p.detach())
            if n:
                bad[name] = n
    return bad


def _nonfinite_count(t: torch.Tensor) -> int:
    """NaN/Inf values in ``t``; a quantised tensor subclass without ``isfinite`` (torchao's Float8Tensor)
    is read through the plain tensors it is made of (``__tensor_flatten__``: its data and scales)."""
    try:
        return int((~torch.isfinite(t)).sum())
    except (NotImplementedError, RuntimeError):
        flatten = getattr(t, "__tensor_flatten__", None)
        if not callable(flatten):
            return 0
        inner = [getattr(t, attr, None) for attr in flatten()[0]]
        return sum(_nonfinite_count(x.float()) for x in inner
                   if isinstance(x, torch.Tensor) and x.is_floating_point())
