"""The per-step sentinel: per-group gradient norms, folded with the loss and the loss scale into
ONE tensor that is read to the host once per optimizer step.

The norms are the accumulated gradient's, before any clipping (HF Trainer and many loops clip
before the optimizer step; one NaN makes the clip factor NaN and poisons every gradient, hiding
the culprit). Two ways to take them:

- fused (one process): one ``torch._foreach_norm`` over every gradient at the step boundary: at
  the first gradient clip of the step (``clip_tap``), or the optimizer's pre-step hook (the
  GradScaler's ``update`` where it skips the step), whichever comes first; a GradScaler's
  ``unscale_`` before it only divides them by the scale, which the read knows (``grads_scaled``).
  A few kernels per step, whatever the number of tensors; none where a default ``clip_grad_norm_``
  computes the same norms (the tap hands them over), with or without a GradScaler. The per-tensor
  norms join the one read and are summed per group on the host. A backward is noticed by one hook on
  the forward's outputs, not one per parameter.
- DDP's buckets (``bucketed``): the step boundary only sees the gradient after the all-reduce
  averaged a NaN into every rank; DDP's communication hook hands over each bucket before that
  (:mod:`.ddp_buckets`): one fused norm per bucket, in the same per-tensor form as the fused read.
- per parameter (FSDP, DeepSpeed, DDP with another communication hook): a
  ``register_post_accumulate_grad_hook`` per parameter, which fires before DDP's reduction, and
  before DeepSpeed moves the gradients into its own buffers. Under FSDP2 it fires after the
  reduce-scatter (the group norms of the whole gradient, summed from the shards across ranks); each
  rank's own gradient is read before it by :mod:`.fsdp_grads` (``pre_reduce``).

The norms are fp32, and an fp32 2-norm overflows once a gradient's elements pass ~1e19 while every one
of them is still finite. Only on a step where a group's norm comes back inf or NaN, the fused read
looks again (``norm_overflow``): finite gradients get their true norm (an explosion, which the
divergence check reports), a non-finite one keeps the step non-finite.
"""
from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ...step.tensors import iter_tensors
from ..core.guard import guarded, guarded_call
from ..core.pipeline import all_finite, total_norm
from ..distributed.ranks import is_sharded, local_tensor
from . import clip_tap
from .history import group_name

if TYPE_CHECKING:
    from ..distributed.fsdp_grads import PreReduceGrads

_WIDE = (torch.float32, torch.float64)  # gradients whose norms are taken in their own dtype (else in fp32)
# The least 2-norm whose fp32 sum of squares overflows: what a finite gradient's overflowed norm is at least
FP32_NORM_OVERFLOW = math.sqrt(torch.finfo(torch.float32).max)


@dataclass
class _ClipPlan:
    """How one clip's stacked per-tensor norms map onto the groups (see ``GradNormCollector.take_from_clip``)."""

    index: list[int]  # per clip norm: its group, or one past the last group (not ours, or not fp32)
    own: Sequence[tuple[torch.Tensor, int]]  # our (parameter, group) pairs the clip's norms do not cover
    shares: bool  # some clip norm is ours


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
    # finite gradients whose fp32 norm overflowed (found with more reads, on that step only): see ``norm_overflow``
    norm_overflow: dict | None = None

    @property  # (not cached: settle() replaces grad_norm across ranks)
    def total_grad_norm(self) -> float:
        return total_norm(self.grad_norm)

    @property
    def grads_finite(self) -> bool:
        return all_finite(self.grad_norm)

    @property
    def loss_finite(self) -> bool:
        return self.loss is None or math.isfinite(self.loss)


@dataclass
class Gathered:
    """One step's numbers stacked on the device (``GradNormCollector.gather``), and how to split them."""

    vector: torch.Tensor | None  # every value, fp32, on the device; None: nothing to read
    n_norms: int
    host_grouped: bool  # per-tensor norms, summed per group on the host (each tensor's group: taken_index)
    taken_index: list[Sequence[int]]
    has_loss: bool
    has_scale: bool
    has_found_inf: bool
    has_activations: bool
    n_acts: int
    with_fingerprint: bool
    n_extra: int
    n_exchanged: int
    norms_scaled: bool

    @property
    def n_checked(self) -> int:
        """How many leading values decide whether the update is finite: the norms and the loss."""
        return self.n_norms + int(self.has_loss)


class GradNormCollector:
    def __init__(self, named_params: list[tuple[str, torch.nn.Parameter]], on_error: Callable[[BaseException], None],
                 grads_scaled: Callable[[], bool] = lambda: False):
        self.groups: list[str] = []
        self._on_error = on_error
        self._grads_scaled = grads_scaled  # fused: are the gradients still multiplied by the loss scale now?
        self.enabled = True
        self.per_parameter = False  # one hook per parameter (FSDP2, DeepSpeed, DDP without our hook), else fused
        self.bucketed = False  # DDP: this rank's own norms come from its communication hook (ddp_buckets)
        self.pre_reduce: PreReduceGrads | None = None  # FSDP2: this rank's own gradients, before the reduce-scatter
        # DDP: this step's norms by bucket index. A loop that accumulates without no_sync reduces every
        # micro-batch; each bucket then holds the gradient accumulated so far: the last one is the step's
        self._bucket_norms: dict[int, list[tuple[torch.Tensor, Sequence[int]]]] = {}
        self.accumulations = 0  # backwards (per-parameter: accumulations) seen, ever
        # a backward ran since the step's last capture: a bool, not a count, because the capture runs inside the
        # forward, where torch.compile traces it and would recompile for every new value of a count it reads
        self.backward_since_capture = False
        self.handles: list = []
        self._tapped = False
        # fused: this step's per-tensor 2-norms once taken, as (norms on the device, each one's group);
        # they ride in the step's one read and are summed per group on the host
        self._taken: list[tuple[torch.Tensor, Sequence[int]]] | None = None
        self._scaled = True  # whether the norms taken this step are of loss-scaled gradients
        self._at_clip = False  # whether they were taken at a clip (the gradients may be scaled since)
        self._backward_seen: Callable[[torch.Tensor], None] | None = None  # fused: the output hook, made once
        self.cover(named_params)

    def cover(self, named_params: list[tuple[str, torch.nn.Parameter]]) -> list[str]:
        """Watch exactly these parameters from now on (a module swapped in after attach); groups
        only grow, so earlier history stays aligned. Returns the groups that are new."""
        attached = bool(self.handles) or self._tapped
        self.detach()
        known = len(self.groups)
        self.params: list[torch.Tensor] = [p for _, p in named_params]
        index = []
        for name, _ in named_params:
            g = group_name(name)
            if g not in self.groups:
                self.groups.append(g)
            index.append(self.groups.index(g))
        self._index = index
        self._ids = {id(p) for p in self.params}
        self._group_of = {id(p): g for p, g in zip(self.params, index)}  # id(parameter) -> its group
        self._sharded = is_sharded(self.params)  # FSDP2 shards: the fingerprint reads each rank's own
        self._clip_plan: tuple[tuple, _ClipPlan] | None = None  # the last clip's layout and how it maps here
        self._index_tensors: dict[torch.device, torch.Tensor] = {}
        self._norms: list[torch.Tensor | None] = [None] * len(self.params)
        if attached:
            self.attach()
        return self.groups[known:]

    def attach(self) -> None:
        if not self.per_parameter:
            clip_tap.tap(self)
            self._tapped = True
            return
        for i, p in enumerate(self.params):
            self.handles.append(p.register_post_accumulate_grad_hook(self._hook(i)))
        if self.pre_reduce is not None:
            self.pre_reduce.attach()

    def detach(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        if self.pre_reduce is not None:
            self.pre_reduce.detach()
        self.release_clip()

    def release_clip(self) -> None:
        """Stop reading at gradient clips (torch's own functions are back once no watch reads them).
        Safe at any point, even inside a hook or the clip itself: it is a module attribute, not a hook
        dict torch is iterating."""
        if self._tapped:
            clip_tap.untap(self)
            self._tapped = False

    # ---- fused: one read of every gradient at the step boundary -----------------------------
    def backward_counter(self) -> Callable[[torch.Tensor], None] | None:
        """The tensor hook that counts a backward (fused read), made once; None where the per-parameter
        hooks count them, or while paused."""
        if self.per_parameter or not self.enabled:
            return None
        if self._backward_seen is None:
            collector = weakref.ref(self)  # the graph must not keep the collector (and the model) alive

            def seen(grad: torch.Tensor) -> None:
                live = collector()
                if live is not None and live.enabled:
                    live.accumulations += 1
                    live.backward_since_capture = True

            self._backward_seen = guarded(seen, self._on_error)  # never break the user's backward
        return self._backward_seen

    def watch_backward(self, output: object, counted: Sequence[torch.Tensor] = ()) -> None:
        """Count the backward through this forward's outputs (one tensor hook each, not one per
        parameter); ``counted``: outputs whose hook already calls ``backward_counter()``."""
        counter = self.backward_counter()
        if counter is None:
            return
        # Every output a backward can start from, the model's own loss among them: TRL's trainers take
        # their loss from the log-probabilities the model returns beside an unused LM loss.
        for _, tensor in iter_tensors(output):
            if tensor.is_floating_point() and tensor.requires_grad and not any(tensor is c for c in counted):
                tensor.register_hook(counter)

    def before_clip(self, parameters: list[torch.Tensor]) -> None:
        """A gradient clip is about to scale ``parameters``' gradients: take the norms now if they are ours."""
        if self.shares_clip(parameters):
            guarded_call(self._on_error, self.take)
            self._at_clip = self._taken is not None

    def shares_clip(self, parameters: list[torch.Tensor]) -> bool:
        """This clip is where this step's norms are read: none taken yet, and some of ``parameters`` are ours."""
        return (self._taken is None and self.enabled and not self.per_parameter and not self.bucketed
                and any(id(p) in self._ids for p in parameters))

    def take_from_clip(self, parameters: list[torch.Tensor], kinds: clip_tap.Kinds, norms: torch.Tensor) -> None:
        """``clip_grad_norm_`` computed ``norms[i]``, the 2-norm of ``parameters[i].grad`` (its groups of
        device and dtype: ``kinds``), before scaling anything: this step's read reuses the fp32 ones.
        Called only where ``shares_clip`` said yes, for the same clip."""
        guarded_call(self._on_error, self._take_from_clip, parameters, kinds, norms)

    def _take_from_clip(self, parameters: list[torch.Tensor], kinds: clip_tap.Kinds, norms: torch.Tensor) -> None:
        key = (tuple(map(id, parameters)), kinds, norms.dtype)
        if self._clip_plan is None or self._clip_plan[0] != key:
            self._clip_plan = (key, self._plan_clip(parameters, kinds, norms.dtype))
        plan = self._clip_plan[1]
        taken = []
        if plan.own:
            with torch.no_grad():
                taken = self._norms_of((p.grad, g) for p, g in plan.own)
        if plan.shares:
            taken.insert(0, (norms, plan.index))  # no device work: the clip's own tensor joins the read
        if taken:
            self._scaled = self._grads_scaled()
            self._taken = taken
            self._at_clip = True

    def _plan_clip(self, parameters: list[torch.Tensor], kinds: clip_tap.Kinds, dtype: torch.dtype) -> _ClipPlan:
        """Which of the clip's norms are this step's (fp32 gradients of ours, each once), and which of
        our parameters need their own norm (not in the clip, or narrower gradients: read in fp32)."""
        spare = len(self.groups)  # the host sum's slot for norms that are not ours
        index: list[int] = []
        shared: set[int] = set()
        at = 0
        for _, kind_dtype, count in kinds:
            for p in parameters[at:at + count]:
                group = self._group_of.get(id(p))
                if group is not None and kind_dtype == dtype == torch.float32 and id(p) not in shared:
                    shared.add(id(p))
                    index.append(group)
                else:
                    index.append(spare)
            at += count
        own = [(p, g) for p, g in zip(self.params, self._index) if id(p) not in shared]
        return _ClipPlan(index, own, bool(shared))

    def take(self) -> None:
        """This step's per-tensor norms of the accumulated gradients, once per step, on the device."""
        if self.per_parameter or not self.enabled or self._taken is not None:
            return
        if self._bucket_norms:  # DDP reduced this step: its buckets held this rank's own gradients
            self._scaled, self._taken = True, [part for parts in self._bucket_norms.values() for part in parts]
            return
        with torch.no_grad():  # a backward with create_graph=True leaves gradients that need grad
            taken = self._norms_of((p.grad, g) for p, g in zip(self.params, self._index))
        if taken:
            self._scaled = self._grads_scaled()
            self._taken = taken

    def take_bucket(self, index: int, parameters: list[torch.Tensor], gradients: list[torch.Tensor]) -> None:
        """DDP's communication hook hands over bucket ``index`` before reducing it (``ddp_buckets``): the
        norms of this rank's own gradients, in the step's read; parameters not ours go to the spare slot."""
        if self.enabled and self._taken is None:
            guarded_call(self._on_error, self._take_bucket, index, parameters, gradients)

    def _take_bucket(self, index: int, parameters: list[torch.Tensor], gradients: list[torch.Tensor]) -> None:
        spare = len(self.groups)
        with torch.no_grad():
            self._bucket_norms[index] = self._norms_of(
                (grad, self._group_of.get(id(p), spare)) for p, grad in zip(parameters, gradients))

    @staticmethod
    def _norms_of(pairs: Iterable[tuple[torch.Tensor | None, int]]) -> list[tuple[torch.Tensor, Sequence[int]]]:
        """The 2-norms of these (gradient, group) pairs (None: no gradient): one stacked tensor per
        device and dtype, with each norm's group."""
        by_kind: dict[tuple[torch.device, torch.dtype], tuple[list[torch.Tensor], list[int]]] = {}
        for grad, group in pairs:
            if grad is not None:
                grads, index = by_kind.setdefault((grad.device, grad.dtype), ([], []))
                grads.append(grad)
                index.append(group)
        # one fused norm per (device, dtype); accumulated in fp32 where the gradients are narrower
        # (an fp16 norm overflows long before its gradient does)
        return [(torch.stack(torch._foreach_norm(grads, 2, dtype=None if dtype in _WIDE else torch.float32)), index)
                for (_, dtype), (grads, index) in by_kind.items()]

    def _hook(self, i: int) -> Callable[[torch.Tensor], None]:
        # Weakly: the garbage collector does not see into a tensor's post-accumulate-grad hooks, so a
        # hook holding the collector (and through it the watch and the model) would be a cycle that is
        # never freed: `del model` would not give the memory back while the watch is attached.
        collector = weakref.ref(self)

        def hook(param: torch.Tensor) -> None:
            live = collector()
            if live is not None and live.enabled and param.grad is not None:
                live.accumulations += 1  # a backward ran: the step's captured micro-batches are in use
                live.backward_since_capture = True
                # FSDP2: the rank's shard; the shards' squares are summed across ranks later
                grad = local_tensor(param.grad.detach())
                live._norms[i] = torch.linalg.vector_norm(grad, dtype=torch.float32)

        def on_error(exc: BaseException) -> None:
            live = collector()
            if live is not None:
                live._on_error(exc)

        return guarded(hook, on_error)  # never break the user's backward

    def reset(self) -> None:
        if self.per_parameter:
            self._norms = [None] * len(self.params)
        self._taken = None
        self._at_clip = False
        self._bucket_norms = {}
        if self.pre_reduce is not None:
            self.pre_reduce.reset()

    def device(self) -> torch.device:
        """Where this step's norms live (the device of the step's read and collective)."""
        if self._taken:
            return self._taken[0][0].device
        ref = next((n for n in self._norms if n is not None), None)
        return ref.device if ref is not None else (self.params[0].device if self.params else torch.device("cpu"))

    @property
    def norms_scaled(self) -> bool:
        """The step's norms are of loss-scaled gradients: per-parameter hooks always read them in the
        backward; the fused read, when the GradScaler had not unscaled them yet."""
        return self.per_parameter or self._scaled

    def fingerprint(self) -> torch.Tensor:
        """Per-group sum of parameter norms: it stays bit-identical only if the weights do."""
        with torch.no_grad():
            norms = torch._foreach_norm([local_tensor(p) for p in self.params] if self._sharded else self.params)
        return self._per_group(norms, square=False)

    def _per_group(self, values: list[torch.Tensor] | tuple[torch.Tensor, ...], square: bool) -> torch.Tensor:
        device = values[0].device if values else torch.device("cpu")
        # Stacked as they are where they already are fp32 on one device (fp32 weights, checked each time:
        # a model cast after attach keeps its Parameter objects); else cast and moved first
        if not all(v.dtype == torch.float32 and v.device == device for v in values):
            values = [v.float().to(device, non_blocking=True) for v in values]
        stacked = torch.stack(values)
        if square:
            stacked = stacked.square()
        return torch.zeros(len(self.groups), device=device, dtype=torch.float32).index_add_(
            0, self._index_on(device), stacked)

    def _index_on(self, device: torch.device) -> torch.Tensor:
        """Parameter -> group index, kept on each device it is used on."""
        idx = self._index_tensors.get(device)
        if idx is None:
            idx = self._index_tensors[device] = torch.tensor(self._index, device=device)
        return idx

    def _group_norms(self) -> torch.Tensor:
        """This step's per-group norms as one tensor on the device (the per-parameter path's read)."""
        zero = torch.zeros((), device=self.device())
        return self._per_group([n if n is not None else zero for n in self._norms], square=True).sqrt()

    def _host_group_norms(self, values: list[float], taken_index: list[Sequence[int]]) -> list[float]:
        """The fused read's per-tensor norms (``values``, in the order they were taken, each tensor's group
        in ``taken_index``) summed per group on the host."""
        squares = [0.0] * (len(self.groups) + 1)  # the last slot: norms of the clip's that are not ours
        at = 0
        for index in taken_index:  # none: no gradient this step (or paused): zeros, as the hooks gave
            for group, value in zip(index, values[at:at + len(index)]):
                squares[group] += value * value
            at += len(index)
        squares.pop()
        return [math.sqrt(v) for v in squares]

    def read(self, losses: list[torch.Tensor], scale: torch.Tensor | None, with_fingerprint: bool,
             sum_losses: bool = False, found_inf: torch.Tensor | None = None,
             activations: Callable[[torch.device], torch.Tensor] | None = None,
             extra: list[torch.Tensor] | None = None,
             exchange: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor] | None = None) -> StepStats:
        """Stack everything this step produced and read it with a single ``tolist()``.

        ``exchange(norms, loss)`` (multi-rank runs) returns the step's all-reduced flags; they are
        appended last and read in the same ``tolist()``.
        """
        gathered = self.gather(losses, scale, with_fingerprint, sum_losses, found_inf, activations, extra, exchange)
        # the one host sync of the step (none: nothing to read)
        values = gathered.vector.tolist() if gathered.vector is not None else []
        return self.decode(gathered, values)

    def gather(self, losses: list[torch.Tensor], scale: torch.Tensor | None, with_fingerprint: bool,
               sum_losses: bool = False, found_inf: torch.Tensor | None = None,
               activations: Callable[[torch.device], torch.Tensor] | None = None,
               extra: list[torch.Tensor] | None = None,
               exchange: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor] | None = None) -> Gathered:
        """Everything this step produced, stacked into one fp32 tensor on the device (no host read): the
        norms first, then the loss, the scale, the GradScaler's flag, activations, fingerprint, detectors'
        scalars and the exchange. ``decode`` turns its values into the step's numbers."""
        # Across ranks the norms are each rank's own, taken before the all-reduce: per parameter, or
        # from DDP's buckets (the watch sets one of them wherever it exchanges)
        host_grouped = not self.per_parameter
        if host_grouped and exchange is not None and not self.bucketed:
            raise ValueError("an exchange across ranks needs this rank's own gradients: the per-parameter "
                             "hooks or DDP's communication hook")
        taken_index: list[Sequence[int]] = []
        if host_grouped:  # the fused read: per-tensor norms, summed per group on the host after the read
            self.take()
            taken = self._taken or []
            device = taken[0][0].device if taken else self.device()
            parts = [norms if norms.device == device else norms.to(device) for norms, _ in taken]
            taken_index = [index for _, index in taken]
            n_norms = sum(len(index) for index in taken_index)
        else:
            parts = [self._group_norms()]
            device = parts[0].device
            n_norms = len(self.groups)
        n_norm_parts = len(parts)
        if losses:
            if len(losses) == 1:  # the mean (or sum) of one loss is that loss
                parts.append(_flat(losses[0], device))
            else:
                stacked = torch.stack([loss.detach().float().to(device) for loss in losses])
                parts.append((stacked.sum() if sum_losses else stacked.mean()).reshape(1))
        shared = None
        if exchange is not None:
            own = parts[0] if n_norm_parts == 1 else (
                torch.cat(parts[:n_norm_parts]) if n_norm_parts else torch.zeros(0, device=device))
            shared = exchange(own, parts[n_norm_parts] if losses else None)
        if scale is not None:
            parts.append(_flat(scale, device))
        if found_inf is not None:
            parts.append(_flat(found_inf, device))
        n_acts = 0
        if activations is not None:
            acts = activations(device)
            n_acts = acts.numel()
            parts.append(acts)
        if with_fingerprint:
            parts.append(self.fingerprint().to(device))
        n_extra = 0
        for tensor in extra or ():
            flat = _flat(tensor, device)
            n_extra += flat.numel()
            parts.append(flat)
        if shared is not None and shared.numel():
            parts.append(shared)
        return Gathered(torch.cat(parts) if parts else None, n_norms, host_grouped, taken_index, bool(losses),
                        scale is not None, found_inf is not None, activations is not None, n_acts, with_fingerprint,
                        n_extra, shared.numel() if shared is not None else 0, self.norms_scaled)

    def decode(self, gathered: Gathered, values: list[float], rereads: bool = True) -> StepStats:
        """The step's numbers from the values of ``gathered.vector``. ``rereads``: on a step whose norm is
        not finite, read the gradients again to tell an overflowed norm from a non-finite gradient
        (``norm_overflow``): only while they are still this step's (not where the read came a step late)."""
        g = gathered
        n_exchanged = g.n_exchanged
        exchanged = values[len(values) - n_exchanged:] if n_exchanged else None
        values = values[:len(values) - n_exchanged]
        extra_values = values[len(values) - g.n_extra:] if g.n_extra else None
        values = values[:len(values) - g.n_extra]
        norms, rest = values[:g.n_norms], values[g.n_norms:]
        if g.host_grouped:
            norms = self._host_group_norms(norms, g.taken_index)
        loss = rest.pop(0) if g.has_loss else None
        loss_scale = rest.pop(0) if g.has_scale else None
        inf_flags = rest.pop(0) if g.has_found_inf else None
        overflow = None
        # rare: more reads, on this step only; not where the loss is already non-finite or the GradScaler
        # found an inf, nor on DDP's reduced gradients (no longer the ones the norms were taken of)
        if rereads and g.host_grouped and not self.bucketed and not inf_flags \
                and (loss is None or math.isfinite(loss)) and not all_finite(norms):
            norms, overflow = self.norm_overflow(norms)
        acts_values, rest = (rest[:g.n_acts], rest[g.n_acts:]) if g.has_activations else (None, rest)
        if loss_scale and g.norms_scaled:
            norms = [v / loss_scale for v in norms]  # activations are forward values: never scaled
            if overflow is not None and overflow["max_abs_grad"] is not None:
                overflow["max_abs_grad"] /= loss_scale
        return StepStats(norms, loss, loss_scale, rest if g.with_fingerprint else None, inf_flags, acts_values,
                         extra_values, exchanged, overflow)

    def norm_overflow(self, norms: list[float]) -> tuple[list[float], dict | None]:
        """Per-group norms that came back inf or NaN, told apart: a non-finite gradient, or finite
        gradients whose fp32 norm overflowed (the sum of squares passes 3.4e38 once elements pass
        ~1e19). The second is an explosion, not a non-finite gradient: its groups get a finite norm.

        Runs only where a norm was not finite, with at most two more host reads on that step: each
        tensor's max |g| (a non-finite one settles its group), then the other tensors of the groups
        left, each scaled by its max |g| (no overflow, and no fp64, which some devices lack). Where
        the norms were read before a clip, the clip has scaled the gradients since:
        ``clip_grad_norm_`` multiplied them by max_norm / inf = 0, which leaves a finite gradient at
        exactly 0 and turns an inf into NaN; such a group gets the least norm that overflows (a lower
        bound), and any other gradient a clip left stays non-finite (a value clip clamps an inf to a
        finite number). Returns the norms and what was found (None: nothing overflowed).
        """
        suspect = {g for g, v in enumerate(norms) if not math.isfinite(v)}
        grads = [(p.grad, g) for p, g in zip(self.params, self._index) if g in suspect and p.grad is not None]
        if not grads:
            return norms, None
        device = grads[0][0].device
        with torch.no_grad():
            amaxes = torch.stack([torch.linalg.vector_norm(grad, float("inf"), dtype=torch.float32).to(device)
                                  for grad, _ in grads]).tolist()
            suspect -= {g for (_, g), amax in zip(grads, amaxes) if not math.isfinite(amax)}  # a real inf/NaN
            measured = [(grad, g, amax) for (grad, g), amax in zip(grads, amaxes) if g in suspect and amax > 0]
            scaled = torch.stack([torch.linalg.vector_norm(grad / amax, dtype=torch.float32).to(device)
                                  for grad, _, amax in measured]).tolist() if measured else []
        squares: dict[int, float] = dict.fromkeys(suspect, 0.0)
        largest: dict[int, float] = dict.fromkeys(suspect, 0.0)
        for (_, group, amax), norm in zip(measured, scaled):
            squares[group] += (amax * norm) ** 2  # on the host, in fp64: no overflow below 1e154
            largest[group] = max(largest[group], amax)
        fixed = list(norms)
        for group, square in squares.items():
            if not self._at_clip:
                fixed[group] = math.sqrt(square)
            elif square == 0.0:  # finite gradients the clip zeroed
                fixed[group] = FP32_NORM_OVERFLOW
            # else: a clip left a finite nonzero gradient, and nothing tells what it was before
        overflowed = sorted(g for g in suspect if math.isfinite(fixed[g]))  # (not the ones a clip left unknown)
        if not overflowed:
            return norms, None
        return fixed, {"groups": [self.groups[g] for g in overflowed], "lower_bound": self._at_clip,
                       "max_abs_grad": None if self._at_clip else max(largest[g] for g in overflowed)}


def _flat(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` as a detached 1-d fp32 tensor on ``device`` for the read's one ``cat`` (no op where it is one)."""
    if tensor.requires_grad:
        tensor = tensor.detach()
    if tensor.dtype != torch.float32:
        tensor = tensor.float()
    if tensor.dim() != 1:
        tensor = tensor.reshape(-1)
    return tensor if tensor.device == device else tensor.to(device)
