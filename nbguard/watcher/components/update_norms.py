"""Per-group update norms (||Δw|| / ||w|| of each optimizer step) and the ``update-spike`` early warning.

How the update is read. Three ways were weighed (measured in ``benchmarks/overhead.py --update-norms``):

- (a) from an Adam-family optimizer's state after the step (lr * m_hat / (sqrt(v_hat) + eps) plus the
  decoupled weight decay): no weight copy, but three or four parameter-sized temporaries per step
  (sqrt, bias correction, eps, the division), a formula per optimizer and per variant (Adam vs AdamW
  weight decay, amsgrad, maximize, fused/capturable step counts, 8-bit states, schedule-free), and
  nothing for SGD or an optimizer we do not know;
- (b) a copy of the trainable parameters before the step, subtracted after it: exact for every
  optimizer (what the step really applied, clipping, weight decay and a dropped update included),
  two gathers (``torch.cat``), one in-place subtraction and one fused norm per step; its memory is at
  most two flat copies of the *trainable* weights (a LoRA: a few MB), bounded by
  ``WatchSettings.update_norm_budget_mb``;
- (c) torch offers nothing that reports the applied update (the optimizer hooks see the same tensors).

(b) it is: cheaper than (a) in kernels and in passes over memory, and right for every optimizer. How the
weights after the step are compared with the copy depends on their size (``GATHER_BELOW``, measured in
``benchmarks/README.md``, "Issue 45, CPU part"): many small tensors (a LoRA's adapters) are gathered a
second time and normed per group over the two flat buffers (a foreach slot per tensor would cost more
than the bytes); large ones (a full fine-tune) are subtracted from the copy in place, tensor by tensor,
and normed per tensor (no second gather: one pass over the weights less, where passes are the cost). The
budget counts what the chosen path holds: the gathered path two flat copies, the per-tensor path one, the
sampled path one sample's rows (about 1/k of a copy). A run over it (a full fine-tune of a large model on a GPU), or whose
weights are sharded (FSDP, DeepSpeed), gets no update norms and the history says why, once.

On a CPU those passes cost a full fine-tune about 3% of its step (the 15M-parameter run of issue 45: copy,
subtraction and two norms over 59 MB, ~13 ms of a ~490 ms step), over the watch's whole budget. There, above
``SAMPLE_ABOVE`` trainable elements, each step reads 1/k of each weight's rows, k = ceil(elements /
SAMPLE_ABOVE): the weight's rows cut into k x ``SPREAD`` runs, step s taking runs s mod k, s mod k + k, ...
The ratios are then those of about 4M weights spread over every tensor, an estimate of the whole's, and every
step is still read and judged (an LR blow-up moves every row, so it is a spike in any sample, in its own step).
The history says so (``GradHistory.update_norm_sampled``: k and the first sampled step), and an
``update-spike`` from a sampled step says its ratio is estimated (``sample_parts`` in its evidence).
Runs spread over the weight, not its first rows: an embedding's rows are tokens, and frequent and rare ones
are both sampled. On a GPU (the passes run on the device, beside the CPU's work): every weight, every step.

The read costs no host sync of its own: the norms are taken on the device right after
``optimizer.step`` (one ``torch._foreach_norm`` over the differences and the weights, per group or per
tensor, summed per group on the host), and
ride in the *next* step's one read as a detector's scalars (under a GradScaler the read comes after
the step, so the same step's). The ratio is to the weights after the update: a LoRA B matrix starts at
zero, and its first update is then 1.0 rather than a division by zero.

The detector judges the run's total ratio (every trainable weight) on a log scale against the run's
own noise, as :mod:`.divergence` judges gradient norms: the level is the median of the last few healthy
log ratios, the noise the median absolute change between consecutive ones; a spike is at least
``min_decades`` above the level AND ``robust_z`` robust standard deviations of the noise. Adam's update
is bounded by its learning rate, so a healthy run's ratio drifts slowly (down, as the weights grow
or the moments settle); an LR blow-up multiplies it at once, one step before the loss and the
gradient norm see the damaged weights.
"""
from __future__ import annotations

import math
import operator
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from ...findings import Event
from ..core.pipeline import StepView, WatchComponent, WatchedRun
from ..core.registry import ComponentSetup, register_component
from ..detectors.divergence import RUN_FIXES, log_norm
from ..detectors.thresholds import WatchSettings
from ..reads.rolling import RobustBaseline, sorted_median

if TYPE_CHECKING:
    from ..core.context import WatchContext
    from ..reads.history import GradHistory
    from ..reads.sentinel import GradNormCollector

SCALAR = "update_norms"
# Mean elements per trainable tensor under which the weights after the step are gathered a second time
# (one op, but a pass over every weight) rather than subtracted tensor by tensor (a foreach slot each, a few
# us on a CPU): the two cost the same near 16k elements per tensor (benchmarks/README.md, "Issue 45, CPU part")
GATHER_BELOW = 16384
# Trainable elements above which a CPU reads 1/k of each weight's rows per step (see the docstring): the
# passes over about 16 MB of fp32, ~4 ms a step on this CPU, whatever the model's size
SAMPLE_ABOVE = 4 * 2 ** 20
# ... as this many runs of rows per weight per step: contiguous runs (a strided view of every k-th row costs
# 2-3x per byte, its norm more) spread over the weight (an embedding's rows are tokens, rare and frequent)
SPREAD = 4


class Layout(NamedTuple):
    """Per norm in a read, its group: the differences' parts, then the weights' (per group or per tensor)."""

    deltas: list[int]
    weights: list[int]
    parts: int = 1  # the read took 1/parts of each weight's rows: its ratios are estimates where it is over 1


@dataclass
class RowSample:
    """One step's share of the per-tensor path: its runs of each weight's rows and their place in the copy."""

    rows: list[torch.Tensor]  # flat views of the weights' sampled runs of rows (each whole weight where k is 1)
    copy: list[torch.Tensor]  # per run, its slice of the copy (subtracted in place)
    normed: list[torch.Tensor]  # what one foreach norm takes: the differences, then the weights


@dataclass
class UpdateSpikeSettings:
    window: int = 16  # healthy steps the step-to-step noise is taken over
    level_steps: int = 5  # the run's level: the median of its last this many healthy log ratios
    warmup: int = 8  # healthy steps seen before a step can be judged (Adam's first steps are its largest)
    min_decades: float = 1.0  # never less than 10x the run's level (an LR warmup doubles it at most)
    robust_z: float = 6.0  # ... and this many robust standard deviations of the run's own changes


class UpdateSpikeJudge:
    """One event per spike: a spike never enters the baseline, and the judge re-arms once a step is back."""

    def __init__(self, settings: UpdateSpikeSettings | None = None):
        self.settings = settings or UpdateSpikeSettings()
        self.baseline = RobustBaseline(self.settings.window, self.settings.level_steps)  # healthy log ratios
        self.group_recent: deque[Sequence[float | None]] = deque(maxlen=self.settings.level_steps)
        self.spiking = False
        self.evidence: dict[str, Any] | None = None

    def level(self) -> float | None:
        return self.baseline.level()

    def threshold(self) -> float | None:
        s = self.settings
        if len(self.baseline) < s.warmup or not self.baseline.changes:
            return None
        return max(s.min_decades, self.baseline.noise_bound(s.robust_z))

    def update(self, step: int, total: float | None, groups: Sequence[str],
               ratios: Sequence[float | None]) -> dict[str, Any] | None:
        """Evidence for a spike at ``step`` (the step whose update it was), or None."""
        value = log_norm(total)
        if value is None:
            return None  # no update (dropped, or zero), or non-finite weights: the NaN watch's
        limit, level = self.threshold(), self.level()
        spiked = limit is not None and level is not None and value - level > limit
        if not spiked:
            self.baseline.append(value)
            self.group_recent.append(ratios)
            self.spiking = False
            return None
        assert level is not None and limit is not None
        if self.spiking and self.evidence is not None:  # the same spike, still going: one event
            if total is not None and total > self.evidence["peak_update_ratio"]:
                self.evidence.update(peak_update_ratio=total, peak_step=step)
            return None
        self.spiking = True
        self.evidence = {
            "update_ratio": total, "recent_level": 10 ** level, "ratio": 10 ** (value - level),
            "decades_above_level": value - level, "threshold_decades": limit,
            "healthy_steps_seen": len(self.baseline), "peak_update_ratio": total, "peak_step": step,
            "largest_groups": self._largest(groups, ratios)}
        return self.evidence

    def _largest(self, groups: Sequence[str], ratios: Sequence[float | None], most: int = 5) -> list[dict[str, Any]]:
        """The groups whose own update ratio jumped most against their recent median."""
        jumps = []
        for i, (name, ratio) in enumerate(zip(groups, ratios)):
            now = log_norm(ratio)
            seen = sorted(v for v in (log_norm(r[i] if i < len(r) else None) for r in self.group_recent)
                          if v is not None)
            if now is None or not seen:
                continue
            jumps.append((now - sorted_median(seen), name, ratio))
        jumps.sort(reverse=True)
        return [{"group": name, "update_ratio": ratio, "ratio": 10 ** rise} for rise, name, ratio in jumps[:most]]


def update_spike_message(evidence: dict[str, Any]) -> str:
    parts = evidence.get("sample_parts")
    estimated = f" (estimated from 1/{parts} of each weight's rows)" if parts else ""
    text = (f"the optimizer's update{estimated} jumped to {evidence['update_ratio']:.3g} of the weights' norm, "
            f"{evidence['ratio']:.3g}x the run's recent level ({evidence['decades_above_level']:.1f} decades; "
            f"the run's own noise allows {evidence['threshold_decades']:.1f})")
    groups = evidence.get("largest_groups") or []
    if groups:
        text += f"; largest in {groups[0]['group']}"
    return text + ": a loss spike often follows (a learning rate too high for this step?)"


class UpdateNorms(WatchComponent):
    """Reads each step's per-group ||Δw|| / ||w|| into the history and judges the total for spikes.

    A watch component: ``before_step`` / ``after_step`` run around ``optimizer.step`` (the watch's one
    wrapper on it), and ``flush`` where training ends or the watch detaches (the last step's norms have
    no next read)."""

    name = "update-norms"

    def __init__(self, collector: GradNormCollector, history: GradHistory, budget_mb: float,
                 settings: UpdateSpikeSettings | None = None):
        self.collector = collector
        self.history = history
        self.budget_bytes = int(budget_mb * 2 ** 20)
        self.judge = UpdateSpikeJudge(settings)
        self.unavailable: str | None = None  # why there are no update norms (said once, in the history)
        # made once (and again if the parameters change): views of the trainable weights ordered by group,
        # two flat buffers (before and after the step), their per-group segments, the groups present
        self._key: tuple[int, ...] | None = None
        self._ordered: list[torch.Tensor] = []
        self._views: list[torch.Tensor] = []
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None
        self._gather = True  # the weights after the step are gathered too (else subtracted tensor by tensor)
        self._normed: list[torch.Tensor] = []  # gathered: what one foreach norm takes (differences, then weights)
        self._samples: list[RowSample] = []  # per tensor: step s reads _samples[s % k] (k = 1: every row)
        self._sample: RowSample | None = None  # the one the copy before this step took
        self._layout = Layout([], [])
        self._copied: int | None = None  # the step whose weights were copied
        self._pending: tuple[int, torch.Tensor, Layout] | None = None  # (step, norms on the device, their layout)
        self._asked: tuple[int, Layout] | None = None  # the pending step this read carries
        self._judged = -1
        self._fresh: tuple[int, list[float | None], float | None] | None = None  # the last taken, for listeners
        self.context: WatchContext | None = None

    # ---- the watch's lifecycle points ---------------------------------------------------------------
    def attach(self, context: WatchContext) -> None:
        self.context = context

    def detach(self) -> None:
        self.flush()  # the last step's update norms: no next read will bring them

    def on_train_end(self) -> None:
        self.flush()

    def before_optimizer_step(self, step: int) -> None:
        deepspeed = self.context is not None and self.context.uses_deepspeed
        self.before_step(step, "DeepSpeed keeps the weights it updates in its own partitions" if deepspeed else None)

    def after_optimizer_step(self, step: int) -> None:
        self.after_step(step)

    def step_payload(self, payload: dict[str, Any]) -> None:
        fresh = self.take_fresh()
        if fresh is not None:  # the update norms this step's read brought (the step before's, or its own)
            payload["update_norm_step"], ratios, payload["total_update_norm"] = fresh
            payload["update_norm"] = dict(zip(self.history.groups, ratios))

    # ---- around optimizer.step (the watch's existing wrapper) ------------------------------------
    def before_step(self, step: int, why_not: str | None = None) -> None:
        """The optimizer is about to step: copy the trainable weights (or say, once, why not)."""
        if self.unavailable is not None:
            return
        if why_not is None and self._stale():  # (the first step, or the parameters changed)
            why_not = self._why_not() or self._prepare()
            if why_not is None and self._layout.parts > 1:
                self.history.record_update_sampling(self._layout.parts, step)
        if why_not is not None:
            self.unavailable = why_not
            self.history.update_norm_unavailable = why_not
            self._views, self._buffers, self._copied, self._pending = [], None, None, None
            return
        assert self._buffers is not None
        with torch.no_grad():
            if self._gather:
                torch.cat(self._views, out=self._buffers[0])
            else:
                self._sample = self._samples[step % len(self._samples)]
                torch._foreach_copy_(self._sample.copy, self._sample.rows)
        self._copied = step

    def after_step(self, step: int) -> None:
        """The optimizer stepped: the differences' and the weights' norms per group, on the device (no host read)."""
        copied, self._copied = self._copied, None
        if copied != step or self._buffers is None or self._stale():
            return
        before, after = self._buffers
        with torch.no_grad():
            if self._gather:
                torch.cat(self._views, out=after)
                before.sub_(after)  # w_before - w_after: -Δw
                normed = self._normed
            else:
                assert self._sample is not None
                torch._foreach_sub_(self._sample.copy, self._sample.rows)  # the same, tensor by tensor, into the copy
                normed = self._sample.normed
            norms = torch._foreach_norm(normed, 2, dtype=torch.float32)
            self._pending = (step, torch.stack(norms), self._layout)

    # Measured (benchmarks/README.md, "Update norms"): per-tensor work is what costs on a LoRA's hundreds
    # of small tensors (a Python view or a foreach slot each, ~5 us), so the weights are gathered with one
    # ``torch.cat`` into a flat buffer ordered by group, from views made once, and the norms are taken
    # per group (a few dozen segments of the buffers), not per tensor. On large tensors the bytes cost
    # instead, and the second gather is left out (``GATHER_BELOW``).
    def _stale(self) -> bool:
        """The trainable parameters changed since the views were made (a module swapped in, ``p.data`` replaced)."""
        params = self.collector.params
        return self._key != tuple(map(id, params)) or not all(
            map(operator.eq, map(torch.Tensor.data_ptr, self._views), map(torch.Tensor.data_ptr, self._ordered)))

    def _prepare(self) -> str | None:
        params = list(self.collector.params)
        index = list(self.collector._index)
        order = sorted(range(len(params)), key=lambda i: index[i])
        ordered = [params[i] for i in order]
        if any(not p.is_contiguous() for p in ordered):
            return "some trainable weights are not contiguous in memory"
        if len({p.dtype for p in ordered}) > 1:
            return "the trainable weights have several dtypes"
        views = [p.detach().view(-1) for p in ordered]
        present = sorted(set(index))
        lengths = [sum(p.numel() for p, g in zip(params, index) if g == group) for group in present]
        total = sum(lengths)
        first = ordered[0]
        gather = total < GATHER_BELOW * len(ordered)
        parts = 1 if gather or first.device.type != "cpu" else -(-total // SAMPLE_ABOVE)
        # each weight's rows (its first dimension; a vector's elements are its rows) cut into parts x SPREAD
        # blocks, in order; sample p takes blocks p, p + parts, ...: SPREAD runs of rows spread over the weight
        blocks = [list(_rows(p).tensor_split(parts * SPREAD if parts > 1 else 1)) for p in ordered]
        samples = [[b.view(-1) for bs in blocks for b in bs[phase::parts]] for phase in range(parts)]
        copied = total if gather else max(sum(b.numel() for b in rows) for rows in samples)
        over = _over_budget(copied, total if gather else 0, parts, first.element_size(), self.budget_bytes)
        if over is not None:
            return over
        buffers = (torch.empty(copied, dtype=first.dtype, device=first.device),
                   torch.empty(total if gather else 0, dtype=first.dtype, device=first.device))
        self._key = tuple(map(id, params))
        self._ordered, self._views, self._buffers, self._gather = ordered, views, buffers, gather
        self._normed, self._samples, self._sample = [], [], None
        if gather:  # per group: the differences' segments of the copy, then the weights' of the second buffer
            self._normed = [*buffers[0].split(lengths), *buffers[1].split(lengths)]
            self._layout = Layout(present, present)
        else:  # per tensor: each one's slice of the copy (its difference after the step), then the weight itself
            groups = [index[i] for i, bs in zip(order, blocks) for _ in bs[::parts]]  # each block's group
            for rows in samples:
                copy = list(buffers[0][:sum(b.numel() for b in rows)].split([b.numel() for b in rows]))
                self._samples.append(RowSample(rows, copy, [*copy, *rows]))
            self._layout = Layout(groups, groups, parts)
        return None

    def _why_not(self) -> str | None:
        params = self.collector.params
        if not params:
            return "no trainable parameters"
        if self.collector._sharded:
            return "the weights are sharded across ranks (FSDP): each rank holds only its shard"
        if any(p.device.type == "meta" for p in params):
            return "some trainable weights are on the meta device"
        if len({p.device for p in params}) > 1:
            return "the trainable weights are spread over several devices"
        return None

    # ---- the read ----------------------------------------------------------------------------------
    def scalars(self, watch: WatchedRun) -> dict[str, torch.Tensor]:
        pending = self._pending
        if pending is None:
            self._asked = None
            return {}
        self._asked = (pending[0], pending[2])
        return {SCALAR: pending[1]}

    def before_update(self, view: StepView) -> list[Event]:
        return self.update(view)

    def update(self, view: StepView) -> list[Event]:
        values = view.scalars.get(SCALAR)
        asked = self._asked
        if not values or asked is None or asked[0] == self._judged:
            return []
        self._judged = asked[0]
        if self._pending is not None and self._pending[0] == asked[0]:
            self._pending = None
        return self._take(asked[0], values, asked[1])

    def rewound(self, step: int) -> None:
        """The restored state's updates are judged afresh: the level learned since it (a dead run's near-zero
        updates) would call the first healthy update after the rewind a spike (it did: 668x)."""
        self.judge = UpdateSpikeJudge(self.judge.settings)
        self._copied = None  # this step's "update" would be the restore itself: no reading of it

    def take_fresh(self) -> tuple[int, list[float | None], float | None] | None:
        """(step, per-group ratios, total) read since the last call, for the watch's step listeners."""
        fresh, self._fresh = self._fresh, None
        return fresh

    def flush(self) -> None:
        """Training ended: the last step's norms (one host read, once)."""
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] != self._judged:
            self._judged = pending[0]
            self._take(pending[0], pending[1].tolist(), pending[2], judge=False)

    def _take(self, step: int, values: Sequence[float], layout: Layout, judge: bool = True) -> list[Event]:
        """``values``: the norms of the differences, then of the weights, each part's group in ``layout``."""
        delta_groups, weight_groups = layout.deltas, layout.weights
        groups = list(self.history.groups)
        delta_sq = [0.0] * len(groups)
        weight_sq = [0.0] * len(groups)
        for g, delta in zip(delta_groups, values):
            delta_sq[g] += delta * delta
        for g, weight in zip(weight_groups, values[len(delta_groups):]):
            weight_sq[g] += weight * weight
        ratios: list[float | None] = [None] * len(groups)
        present = sorted(set(delta_groups))
        for g in present:
            ratios[g] = _ratio(delta_sq[g], weight_sq[g])
        total = _ratio(sum(delta_sq[g] for g in present), sum(weight_sq[g] for g in present))
        self.history.record_update(step, ratios, total)
        self._fresh = (step, ratios, total)
        if not judge:
            return []
        found = self.judge.update(step, total, groups, ratios)
        if found is None:
            return []
        if layout.parts > 1:  # the ratio it quotes is an estimate from 1/parts of each weight's rows
            found["sample_parts"] = layout.parts
        found["fixes"] = list(RUN_FIXES)
        return [Event("update-spike", step, update_spike_message(found), evidence=found)]


def _over_budget(copy: int, second: int, parts: int, element_size: int, budget_bytes: int) -> str | None:
    """Why the chosen path's buffers (elements: the copy before the step, the weights gathered after it, 0 where
    they are compared tensor by tensor) do not fit the budget; None where they do."""
    size = (copy + second) * element_size
    if size <= budget_bytes:
        return None
    if second:
        what = "two flat copies of the trainable weights (gathered per group) take"
    elif parts > 1:
        what = f"a copy of 1/{parts} of each trainable weight's rows (the sampled CPU path) takes"
    else:
        what = "one copy of the trainable weights (compared tensor by tensor) takes"
    return (f"{what} {size / 2 ** 20:.1f} MiB, over the update-norm budget of {budget_bytes / 2 ** 20:.0f} MiB "
            f"(WatchSettings(update_norm_budget_mb=...))")


def _rows(weight: torch.Tensor) -> torch.Tensor:
    """The weight as rows (a view): its first dimension; a vector's elements, a scalar or an empty weight one row."""
    rows = weight.shape[0] if weight.dim() and weight.shape[0] else 1
    return weight.detach().view(rows, weight.numel() // rows)


def _ratio(delta_sq: float, weight_sq: float) -> float | None:
    if not math.isfinite(delta_sq) or not math.isfinite(weight_sq):
        return math.nan
    if weight_sq <= 0.0:
        return None
    return math.sqrt(delta_sq / weight_sq)


def make_update_norms(setup: ComponentSetup) -> UpdateNorms | None:
    """The watch's update-norm reader, or None where ``WatchSettings(update_norms=False)``."""
    thresholds = setup.thresholds if setup.thresholds is not None else WatchSettings()  # its defaults: one source
    if not thresholds.update_norms:
        return None
    return UpdateNorms(setup.reads, setup.history, thresholds.update_norm_budget_mb)


register_component("update_norms", make_update_norms,
                   summary="per-group ||Δw|| / ||w|| of each update and the update-spike check "
                           "(WatchSettings(update_norms=False) turns it off)")
