"""The opt-in activation probe: each module group's output abs-max per optimizer step.

Forward hooks on the group modules (the same groups as the gradient history) keep a running
maximum on the device, over the step's training micro-batches. Nothing is read here: the
collector folds :meth:`ActivationProbe.values` into the step's single host read.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from ...step.eager import unwrap_compiled
from ...step.tensors import iter_tensors
from ..core.guard import guarded

FP16_LIMIT = float(torch.finfo(torch.float16).max)  # 65504: the largest finite fp16 value
NOT_SEEN = -1.0  # an abs-max is never negative: marks a group that ran no training forward this step


def group_modules(model: torch.nn.Module, groups: list[str]) -> list[tuple[str, torch.nn.Module]]:
    """(group, module) for every group that names a submodule (a parameter on the root has none).
    Group names are eager names (no torch.compile prefix): looked up on the eager module."""
    model = unwrap_compiled(model)[0]
    found = []
    for group in groups:
        try:
            module = model.get_submodule(group)
        except AttributeError:
            continue
        if module is not model:
            found.append((group, module))
    return found


def output_absmax(output) -> torch.Tensor | None:
    """The abs-max of a module's primary output (its first floating tensor), on its device.

    One ``aminmax`` pass in x's own dtype (exact: no fp32 copy, no |x| temporary; on CPU ~10x
    faster than ``vector_norm(ord=inf)``); inf and NaN propagate.
    """
    for _path, t in iter_tensors(output):
        if t.is_floating_point() and t.numel():
            lo, hi = torch.aminmax(t.detach())
            return torch.maximum(hi, -lo).float()
    return None


class ActivationProbe:
    def __init__(self, model: torch.nn.Module, groups: list[str], recording: Callable[[torch.nn.Module], bool],
                 on_error: Callable[[BaseException], None]):
        self.modules = group_modules(model, groups)
        self.groups = [g for g, _ in self.modules]
        self._recording = recording  # the watch's "is this a training forward" test
        self._on_error = on_error
        self._max: list[torch.Tensor | None] = [None] * len(self.modules)
        self.handles: list = []

    def attach(self) -> None:
        for i, (_group, module) in enumerate(self.modules):
            self.handles.append(module.register_forward_hook(self._hook(i)))

    def detach(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def reset(self) -> None:
        self._max = [None] * len(self.modules)

    def _hook(self, i: int) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: tuple, output: object) -> None:
            if not self._recording(module):
                return
            absmax = output_absmax(output)
            if absmax is not None:
                seen = self._max[i]
                self._max[i] = absmax if seen is None else torch.maximum(seen, absmax.to(seen.device))
        return guarded(hook, self._on_error)  # never break the user's forward

    def values(self, device: torch.device) -> torch.Tensor:
        """One float32 tensor on ``device``: the step's abs-max per group, NOT_SEEN where none ran."""
        if not self._max:
            return torch.empty(0, device=device)
        unseen = torch.full((), NOT_SEEN, device=device)
        return torch.stack([v.to(device, non_blocking=True) if v is not None else unseen for v in self._max])


def host_values(values: list[float]) -> list[float | None]:
    return [None if v == NOT_SEEN else v for v in values]
