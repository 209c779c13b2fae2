"""Under FSDP2, each rank's own gradient, read before the reduce-scatter averages it into every shard.

FSDP2 (``fully_shard``) computes each parameter's whole gradient on every rank, in the module's
unsharded parameter, then reduce-scatters it. From then on a NaN born on one rank is in every rank's
shard, and the sentinel's hooks on the sharded parameters (FSDP calls them after the reduction) cannot
tell which rank made it. This reader hooks the unsharded parameters themselves
(``register_post_accumulate_grad_hook``): autograd calls the hook once it has accumulated this rank's
own gradient there, before FSDP's post-backward takes that gradient away to reduce it. The hook takes
each gradient's least and greatest element (one ``aminmax``: non-finite exactly when an element is,
and unlike a 2-norm it cannot overflow; on CPU it costs what a 2-norm does, an inf-norm 15 times that);
the step's exchange sends "this rank's own gradient was non-finite" as the rank's GRADS flag.
The group norms still come from the reduced shards: they are the whole (averaged) gradient's.

Why not a custom reduce-scatter (``FSDPModule.set_custom_reduce_scatter``, a public API): it takes the
one slot a user's own reduce-scatter (or FSDP's symmetric-memory one) needs, and it sits inside the
collective; these hooks only look. They need FSDP's private objects (each module's state, its
parameter groups' ``FSDPParam``s and their ``_unsharded_param``): where this torch lacks them, the
reader says why (``missing``) and stays inert, and the watch reads as before (reduced shards: a
non-finite gradient is caught, its rank is not named).

FSDP makes a group's unsharded parameters at its first all-gather, inside the first forward, and keeps
the same objects after; a forward hook on the watched model hooks any it has not hooked yet.
"""
from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ...document.outward import warn
from ..core.guard import guarded, guarded_call
from ..reads.history import group_name
from .ranks import local_tensor


def fsdp_params(model: torch.nn.Module) -> list[Any]:
    """Every ``FSDPParam`` of the model's FSDP2 modules, once each (FSDP's private objects: raises
    where this torch does not have them)."""
    from torch.distributed.fsdp import FSDPModule

    found: dict[int, Any] = {}
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None)  # torch 2.13: a module may have several
        if groups is None:
            group = state._fsdp_param_group  # earlier releases: one, or None
            groups = [group] if group is not None else []
        for group in groups:
            for param in group.fsdp_params:
                found.setdefault(id(param), param)
    return list(found.values())


class PreReduceGrads:
    """This rank's own gradients under FSDP2: a hook on each unsharded parameter, read in the step's
    exchange (``flag``) and, on a bad step, on the bad rank (``findings``)."""

    def __init__(self, model: torch.nn.Module, named: Sequence[tuple[str, torch.Tensor]], collector: Any):
        # (collector: the sentinel's GradNormCollector, which owns this reader: its enabled flag and on_error)
        self._model = weakref.ref(model)
        self._collector = weakref.ref(collector)  # the hooks must not keep the watch (and the model) alive
        # (FSDPParam, the user's parameter name) for each watched parameter FSDP manages
        self._pairs: list[tuple[Any, str]] = []
        self.missing: str | None = None  # why this rank's own gradients cannot be read here
        try:
            self._pairs = self._find(model, named)
        except Exception as exc:  # FSDP's private objects are absent or changed in this torch
            self.missing = f"FSDP's internals are not what nbguard reads ({type(exc).__name__}: {exc})"
        if not self._pairs and self.missing is None:
            self.missing = "no watched parameter is managed by FSDP"
        self._hooked: list[torch.Tensor | None] = [None] * len(self._pairs)  # the unsharded parameter hooked
        self._handles: dict[int, Any] = {}  # parameter index -> the hook on its current unsharded parameter
        self._forward_handle: Any = None
        # this step's (least, greatest) element of each accumulated gradient, in firing (backward) order
        self._extremes: list[torch.Tensor] = []  # two 0-d tensors per accumulation, in the gradient's dtype
        self._fired: list[int] = []  # which pair each accumulation is

    @staticmethod
    def _find(model: torch.nn.Module, named: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[Any, str]]:
        names = {id(p): n for n, p in named}
        pairs = []
        for param in fsdp_params(model):
            name = names.get(id(param.sharded_param))
            if name is not None:
                if not callable(getattr(param, "init_unsharded_param", None)):  # what makes _unsharded_param
                    raise AttributeError("FSDPParam.init_unsharded_param")
                pairs.append((param, name))
        return pairs

    @property
    def available(self) -> bool:
        return self.missing is None

    # ---- hooks -----------------------------------------------------------------------------------------
    def attach(self) -> None:
        model = self._model()
        if self.available and model is not None and self._forward_handle is None:
            reader = weakref.ref(self)

            def adopt(module: torch.nn.Module, args: Any, output: Any) -> None:
                live = reader()
                if live is not None:
                    live._adopt()

            self._forward_handle = model.register_forward_hook(guarded(adopt, self._weak_report()))

    def detach(self) -> None:
        if self._forward_handle is not None:
            self._forward_handle.remove()
            self._forward_handle = None
        for handle in self._handles.values():
            handle.remove()
        self._handles.clear()
        self._hooked = [None] * len(self._pairs)
        self.reset()

    def _adopt(self) -> None:
        """After a forward: hook the unsharded parameters FSDP made (its first all-gathers) or replaced."""
        for k, (param, _) in enumerate(self._pairs):
            unsharded = getattr(param, "_unsharded_param", None)
            if unsharded is not None and unsharded is not self._hooked[k]:
                if k in self._handles:  # FSDP replaced it: the old one's hook goes with it
                    self._handles[k].remove()
                self._handles[k] = unsharded.register_post_accumulate_grad_hook(self._hook(k))
                self._hooked[k] = unsharded

    def _hook(self, k: int) -> Callable[[torch.Tensor], None]:
        reader = weakref.ref(self)  # weakly: the garbage collector does not see into a tensor's hooks

        def hook(unsharded: torch.Tensor) -> None:
            live = reader()
            collector = live._collector() if live is not None else None
            if live is None or collector is None or not collector.enabled or unsharded.grad is None:
                return
            grad = local_tensor(unsharded.grad.detach())
            if grad.numel():  # (aminmax has no answer for an empty tensor)
                live._extremes.extend(torch.aminmax(grad))
                live._fired.append(k)

        return guarded(hook, self._weak_report())  # never break the user's backward

    def _weak_report(self) -> Callable[[BaseException], None]:
        """A hook's error handler: the collector's (the watch records it and steps aside), held weakly."""
        reader = weakref.ref(self)

        def on_error(exc: BaseException) -> None:
            live = reader()
            collector = live._collector() if live is not None else None
            if collector is not None:
                collector._on_error(exc)

        return on_error

    def reset(self) -> None:
        self._extremes = []
        self._fired = []

    # ---- reads -----------------------------------------------------------------------------------------
    def flag(self, device: torch.device) -> torch.Tensor:
        """1.0 where this step's own gradient had a non-finite element (0-d, on ``device``, not read)."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for value in self._extremes:  # stacked per dtype: no cast per gradient
            by_dtype.setdefault(value.dtype, []).append(value)
        if not by_dtype:
            return torch.zeros((), device=device)
        bad = [(~torch.isfinite(torch.stack(values))).any() for values in by_dtype.values()]
        return (bad[0] if len(bad) == 1 else torch.stack(bad).any()).float().to(device)

    def findings(self) -> dict[str, Any]:
        """Where this rank's own gradient went non-finite (a bad step's one extra host read, on the bad
        rank only): the first parameter whose gradient did in backward order, the last one before it
        that stayed finite, and the groups."""
        if not self._extremes:
            return {}
        extremes = torch.stack([v.float() for v in self._extremes]).tolist()
        values = [lo + hi for lo, hi in zip(extremes[::2], extremes[1::2])]  # non-finite if either is
        bad = [at for at, v in enumerate(values) if not math.isfinite(v)]
        if not bad:
            return {}
        first = bad[0]
        before = next((self._pairs[self._fired[at]][1] for at in range(first - 1, -1, -1)
                       if math.isfinite(values[at])), None)
        groups = list(dict.fromkeys(group_name(self._pairs[self._fired[at]][1]) for at in bad))
        return {"read": "before FSDP's reduce-scatter", "first_nonfinite_parameter": self._pairs[self._fired[first]][1],
                "last_finite_parameter_before": before, "nonfinite_groups": groups,
                "note": "this rank's own gradients in backward order: the non-finite value was made in the "
                        "backward between these two parameters' gradients (no replay under FSDP: a rank "
                        "replaying alone would wait in FSDP's all-gathers)"}


def read_before_reduce(model: torch.nn.Module, named: Sequence[tuple[str, torch.Tensor]],
                       collector: Any) -> PreReduceGrads:
    """The reader for this FSDP2 model, given to the collector (attach, detach, reset with it); one
    that cannot read (``missing``) warns once and stays inert."""
    reader = PreReduceGrads(model, named, collector)
    if reader.missing is not None:
        guarded_call(lambda exc: None, warn,
                     f"nbguard: under FSDP2 the watch reads gradients after the reduce-scatter here "
                     f"({reader.missing}): a non-finite gradient is caught, but not the rank it came from",
                     RuntimeWarning, stacklevel=3)
    collector.pre_reduce = reader
    return reader
