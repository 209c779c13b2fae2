"""The per-step sentinel: gradient norms per parameter taken as each gradient is accumulated
(so before any clipping), folded with the loss and the loss scale into ONE tensor that is read
to the host once per optimizer step.

Why ``register_post_accumulate_grad_hook``: HF Trainer (and many loops) clip gradients before the
optimizer step; one NaN makes the clip factor NaN and poisons every gradient, hiding the culprit.
The hook fires after each accumulation, so the last value it records in a step is the norm of
the full accumulated gradient, before clipping or unscaling.
"""
from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .distributed import local_tensor
from .guard import guarded
from .history import group_name


@dataclass
class StepStats:
    """What the host learns about one optimizer step, from one read."""

    grad_norm: list[float]  # per group, unscaled
    loss: float | None
    loss_scale: float | None
    fingerprint: list[float] | None
    found_inf: float | None = None  # the GradScaler's verdict, when one is used
    activations: list[float] | None = None  # per probed group output abs-max (NOT_SEEN: no forward)
    extra: list[float] | None = None  # the detectors' scalars, flattened (pipeline.DetectorBoard splits them)
    exchanged: list[float] | None = None  # across ranks: what the step's one collective returned

    @property
    def total_grad_norm(self) -> float:
        return math.sqrt(sum(v * v for v in self.grad_norm))

    @property
    def grads_finite(self) -> bool:
        return all(math.isfinite(v) for v in self.grad_norm)

    @property
    def loss_finite(self) -> bool:
        return self.loss is None or math.isfinite(self.loss)


class GradNormCollector:
    def __init__(self, named_params: list[tuple[str, torch.nn.Parameter]], on_error: Callable[[BaseException], None]):
        self.params = [p for _, p in named_params]
        self.groups: list[str] = []
        index = []
        for name, _ in named_params:
            g = group_name(name)
            if g not in self.groups:
                self.groups.append(g)
            index.append(self.groups.index(g))
        self._index = index
        self._index_tensors: dict[torch.device, torch.Tensor] = {}
        self._norms: list[torch.Tensor | None] = [None] * len(self.params)
        self._on_error = on_error
        self.enabled = True
        self.handles: list = []

    def attach(self) -> None:
        for i, p in enumerate(self.params):
            self.handles.append(p.register_post_accumulate_grad_hook(self._hook(i)))

    def detach(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def _hook(self, i: int) -> Callable[[torch.Tensor], None]:
        # Weakly: the garbage collector does not see into a tensor's post-accumulate-grad hooks, so a
        # hook holding the collector (and through it the watch and the model) would be a cycle that is
        # never freed: `del model` would not give the memory back while the watch is attached.
        collector = weakref.ref(self)

        def hook(param: torch.Tensor) -> None:
            live = collector()
            if live is not None and live.enabled and param.grad is not None:
                # FSDP2: the rank's shard; the shards' squares are summed across ranks later
                grad = local_tensor(param.grad.detach())
                live._norms[i] = torch.linalg.vector_norm(grad, dtype=torch.float32)

        def on_error(exc: BaseException) -> None:
            live = collector()
            if live is not None:
                live._on_error(exc)

        return guarded(hook, on_error)  # never break the user's backward

    def reset(self) -> None:
        self._norms = [None] * len(self.params)

    def device(self) -> torch.device:
        """Where this step's norms live (the device of the step's read and collective)."""
        ref = next((n for n in self._norms if n is not None), None)
        return ref.device if ref is not None else (self.params[0].device if self.params else torch.device("cpu"))

    def fingerprint(self) -> torch.Tensor:
        """Per-group sum of parameter norms: it stays bit-identical only if the weights do."""
        norms = torch._foreach_norm([local_tensor(p.detach()) for p in self.params])
        return self._per_group([n.float() for n in norms], square=False)

    def _per_group(self, values: list[torch.Tensor], square: bool) -> torch.Tensor:
        device = values[0].device if values else torch.device("cpu")
        stacked = torch.stack([v.to(device, non_blocking=True) for v in values])
        if square:
            stacked = stacked.square()
        idx = self._index_tensors.get(device)
        if idx is None:
            idx = self._index_tensors[device] = torch.tensor(self._index, device=device)
        return torch.zeros(len(self.groups), device=device, dtype=torch.float32).index_add_(0, idx, stacked)

    def read(self, losses: list[torch.Tensor], scale: torch.Tensor | None, with_fingerprint: bool,
             sum_losses: bool = False, found_inf: torch.Tensor | None = None,
             activations: Callable[[torch.device], torch.Tensor] | None = None,
             extra: list[torch.Tensor] | None = None,
             exchange: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor] | None = None) -> StepStats:
        """Stack everything this step produced and read it with a single ``tolist()``.

        ``exchange(norms, loss)`` (multi-rank runs) returns the step's all-reduced flags; they are
        appended last and read in the same ``tolist()``.
        """
        device = self.device()
        zero = torch.zeros((), device=device)
        parts = [self._per_group([n if n is not None else zero for n in self._norms], square=True).sqrt()]
        if losses:
            stacked = torch.stack([loss.detach().float().to(device) for loss in losses])
            parts.append((stacked.sum() if sum_losses else stacked.mean()).reshape(1))
        n_exchanged = 0
        if exchange is not None:
            shared = exchange(parts[0], parts[1] if losses else None)
            n_exchanged = shared.numel()
        if scale is not None:
            parts.append(scale.detach().float().reshape(1).to(device))
        if found_inf is not None:
            parts.append(found_inf.detach().float().reshape(1).to(device))
        n_acts = 0
        if activations is not None:
            acts = activations(device)
            n_acts = acts.numel()
            parts.append(acts)
        if with_fingerprint:
            parts.append(self.fingerprint().to(device))
        n_extra = 0
        if extra:
            flat = torch.cat([t.detach().float().reshape(-1).to(device) for t in extra])
            n_extra = flat.numel()
            parts.append(flat)
        if n_exchanged:
            parts.append(shared)
        values = torch.cat(parts).tolist()  # the one host sync of the step
        exchanged = values[len(values) - n_exchanged:] if n_exchanged else None
        values = values[:len(values) - n_exchanged]
        extra_values = values[len(values) - n_extra:] if n_extra else None
        values = values[:len(values) - n_extra]
        g = len(self.groups)
        norms, rest = values[:g], values[g:]
        loss = rest.pop(0) if losses else None
        loss_scale = rest.pop(0) if scale is not None else None
        inf_flags = rest.pop(0) if found_inf is not None else None
        acts_values, rest = (rest[:n_acts], rest[n_acts:]) if activations is not None else (None, rest)
        if loss_scale:
            norms = [v / loss_scale for v in norms]  # activations are forward values: never scaled
        return StepStats(norms, loss, loss_scale, rest if with_fingerprint else None, inf_flags, acts_values,
                         extra_values, exchanged)
