"""Runs that blow up or stop learning without a NaN: a gradient-norm explosion judged against the
run's own noise, and a dead run (gradient norm exactly 0, or a loss constant to the last digit).

Both read only what the sentinel already read for the step (the per-group gradient norms and the
loss): no device work, no extra host sync.

Why robust statistics on log scale: gradient norms are multiplicative (a healthy run drifts over
decades as it memorises), so a ratio to the median alone fires on healthy runs (2.02 at 10.6x the
median on a 24-layer LoRA run memorising one batch). The run's level is the median of its last few
log10 norms; its noise is the median absolute change from one step to the next (a run that falls
steadily over three decades has small steps, not a wide spread). An explosion is far outside that
noise AND at least ``min_decades`` above the level, so neither a quiet run's small noise nor a noisy
run's wide swings fire it. A learning rate of 1000 jumps 8-13 decades in one step.

The loss is the context: while it is still below its recent median (the run is learning), a jump
must also pass ``falling_loss_decades``, which no learning-rate explosion misses.

A step whose fp32 gradient norm overflowed over finite gradients (the sentinel's ``norm_overflow``:
elements past ~1e19) is an explosion whatever the history: no healthy run gets there.

A climb is the slow form (a warmup to a learning rate far too high: TRL's ``sft.py`` at LR 1.0 rose
from loss 4.84 to 17.7 with no step's gradient norm far from the last): the loss's level (the median
of its last few steps) doubled AND rose a nat from its lowest, went past where the run started (it
lost all it had learned), and the gradient norm's level doubled with it. A memorising run's loss
falls; a noisy batch moves one value, not a median.
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..reads.rolling import RobustBaseline, RollingMedian


@dataclass
class DivergenceSettings:
    window: int = 16  # healthy steps the step-to-step noise is taken over
    level_steps: int = 5  # the run's level: the median of its last this many healthy log norms
    warmup: int = 1  # healthy steps seen before a step can be judged
    early_steps: int = 5  # until this many healthy steps, only a jump of early_decades counts
    early_decades: float = 3.0  # 1000x the level: no healthy run jumps that far, even at its start
    min_decades: float = 2.0  # with a full baseline, never less than a 100x jump
    falling_loss_decades: float = 3.0  # ... and 1000x while the loss is below its recent median
    robust_z: float = 6.0  # ... and this many robust standard deviations of the run's own steps
    # ... but 10x is enough while the loss has more than doubled past its recent median (an LR blow-up
    # under AdamW: the update is bounded by the LR, so the gradient norm rises ~10-50x, the loss 10x)
    rising_loss_decades: float = 1.0
    rising_loss_factor: float = 2.0
    # a ramp that each step's judgement absorbs (every step enters the baseline): over the last
    # ramp_steps steps the gradient norm rose ramp_decades (30x) from its lowest AND the loss rose
    # ramp_loss_factor from that step's; a learning run's loss falls, so it never fires there
    ramp_steps: int = 4
    ramp_decades: float = 1.5
    ramp_loss_factor: float = 1.5
    # a climb: the median of the last climb_window losses at climb_factor x its lowest AND climb_nats above
    # it, past the first such median (where the run started), with the gradient norm's median at
    # climb_grad_factor x its value then
    climb_window: int = 5
    climb_factor: float = 2.0
    climb_nats: float = 1.0
    climb_grad_factor: float = 2.0
    dead_after: int = 4  # consecutive dead steps (zero gradient or bit-identical loss) that make an event


def log_norm(value: float | None) -> float | None:
    """log10 of a positive finite norm; None for 0, non-finite or missing (others judge those)."""
    if value is None or not math.isfinite(value) or value <= 0:
        return None
    return math.log10(value)


@dataclass(frozen=True)
class JumpBounds:
    """``DivergenceDetector.update``'s test of the next step, as numbers (``DivergenceDetector.bounds``): it
    explodes where its log10 norm is above ``level`` by more than ``limit`` (``limit_falling`` while the loss
    is below ``loss_median``), or by more than ``rising`` while the loss is past ``rising_loss_factor`` x
    ``loss_median``, or ``ramp_decades`` above the trail's lowest ``ramp[0]`` while the loss is past
    ``ramp_loss_factor`` x the loss then (``ramp[1]``). A None part cannot fire yet."""

    level: float | None
    limit: float | None
    limit_falling: float | None
    loss_median: float | None
    rising: float | None
    ramp: tuple[float, float] | None
    settings: DivergenceSettings


class DivergenceDetector:
    """Judges each step's total gradient norm against the recent healthy steps (log scale).

    Exploded steps never enter the baseline, so the run is judged against its last good state. One
    event per explosion: it re-arms once a step is back within bounds.
    """

    def __init__(self, settings: DivergenceSettings | None = None):
        self.settings = settings or DivergenceSettings()
        # the last healthy log norms: the run's level and its step-to-step noise
        self.baseline = RobustBaseline(self.settings.window, self.settings.level_steps)
        self.recent_loss: deque[float] = deque(maxlen=self.settings.window)
        # the last healthy steps' per-group norms, raw (in the order of the groups then known): logs are
        # taken only when an explosion is named
        self.group_recent: deque[Sequence[float]] = deque(maxlen=self.settings.level_steps)
        # (step, log norm, loss) of the last ramp_steps + 1 steps with a finite norm, judged or not
        self.trail: deque[tuple[int, float, float | None]] = deque(maxlen=self.settings.ramp_steps + 1)
        self.exploding = False
        self.last_explosion: int | None = None  # the step of the last explosion reported
        self.evidence: dict[str, Any] | None = None  # the last explosion's: its later steps update its peak

    def level(self) -> float | None:
        """The run's recent log10 gradient norm (None before any healthy step)."""
        return self.baseline.level()

    def threshold(self, loss_falling: bool = False) -> float | None:
        """Decades above the level that count as an explosion (None: not enough history)."""
        s = self.settings
        if len(self.baseline) < s.warmup:
            return None
        if len(self.baseline) < s.early_steps:
            return max(s.early_decades, s.falling_loss_decades) if loss_falling else s.early_decades
        floor = max(s.min_decades, s.falling_loss_decades) if loss_falling else s.min_decades
        return max(floor, self.baseline.noise_bound(s.robust_z))

    def bounds(self) -> JumpBounds | None:
        """What ``update`` will compare the next step with, as plain numbers: the run so far decides them, so
        the step in flight can be judged on the device before its numbers reach the host (``read="deferred"``).
        None: the next step cannot start a new explosion (one is under way)."""
        if self.exploding:
            return None
        s = self.settings
        level = self.level()
        limit, falling = self.threshold(), self.threshold(loss_falling=True)
        rising = s.rising_loss_decades if level is not None and len(self.baseline) >= s.early_steps else None
        ramp = None
        if self.trail:
            _, low, low_loss = min(self.trail, key=lambda t: t[1])
            if low_loss is not None and math.isfinite(low_loss) and low_loss > 0:
                ramp = (low, low_loss)
        return JumpBounds(level, limit, falling, statistics.median(self.recent_loss) if self.recent_loss else None,
                          rising, ramp, s)

    def update(self, step: int, loss: float | None, total: float, groups: Sequence[str],
               norms: Sequence[float], overflow: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """Evidence for an explosion at ``step``, or None. ``norms[i]``: the gradient norm of ``groups[i]``;
        ``overflow``: the sentinel's account of finite gradients whose fp32 norm overflowed."""
        value = log_norm(total)
        if value is None:
            return None  # 0 is the dead-run detector's, a non-finite norm the NaN watch's
        limit, median = self.threshold(), self.level()
        jumped = limit is not None and median is not None and value - median > limit
        s = self.settings
        rising = not jumped and median is not None and len(self.baseline) >= s.early_steps \
            and value - median > s.rising_loss_decades
        loss_median: float | None = None
        loss_falling = False
        if jumped or rising or overflow is not None:  # (the loss's median only where it can matter)
            loss_median = statistics.median(self.recent_loss) if self.recent_loss else None
            loss_falling = loss is not None and loss_median is not None and loss < loss_median
        if jumped and loss_falling:
            limit = self.threshold(loss_falling=True)
            jumped = limit is not None and median is not None and value - median > limit
        if rising and loss is not None and loss_median is not None and loss_median > 0 \
                and loss > s.rising_loss_factor * loss_median:
            jumped, limit = True, s.rising_loss_decades
        ramp = None if jumped else self._ramp(value, loss)
        if ramp is not None:
            jumped, limit = True, s.ramp_decades
        self.trail.append((step, value, loss))
        exploded = jumped or overflow is not None
        if not exploded:
            self._remember(value, loss, norms)
            self.exploding = False
            return None
        if self.exploding and self.evidence is not None:  # the same explosion, still going: one event
            if total > self.evidence["peak_grad_norm"]:
                self.evidence.update(peak_grad_norm=total, peak_step=step)
            if overflow is not None:
                self.evidence.setdefault("fp32_norm_overflow", {"step": step, **overflow})
            return None
        self.exploding, self.last_explosion = True, step
        above = value - median if median is not None else None
        self.evidence = {
            "total_grad_norm": total, "recent_level": 10 ** median if median is not None else None,
            "ratio": 10 ** above if above is not None else None, "decades_above_level": above,
            "threshold_decades": limit, "healthy_steps_seen": len(self.baseline), "loss": loss,
            "recent_loss_median": loss_median, "loss_falling": loss_falling, "peak_grad_norm": total, "peak_step": step,
            "exploded_groups": self._exploded_groups(groups, norms, limit if limit is not None else 0.0)}
        if overflow is not None:
            self.evidence["fp32_norm_overflow"] = {"step": step, **overflow}
        if ramp is not None:
            self.evidence["ramp"] = ramp
        return self.evidence

    def _ramp(self, value: float, loss: float | None) -> dict[str, Any] | None:
        """The gradient norm's rise over the last few steps from its lowest, when the loss rose with it."""
        s = self.settings
        if loss is None or not math.isfinite(loss) or not self.trail:
            return None
        start, low, start_loss = min(self.trail, key=lambda t: t[1])
        if value - low < s.ramp_decades or start_loss is None or not math.isfinite(start_loss) or start_loss <= 0 \
                or loss < s.ramp_loss_factor * start_loss:
            return None
        return {"from_step": start, "grad_norm_ratio": 10 ** (value - low), "loss_ratio": loss / start_loss,
                "over_steps": len(self.trail)}

    def _remember(self, value: float, loss: float | None, norms: Sequence[float]) -> None:
        self.baseline.append(value)
        if loss is not None and math.isfinite(loss):
            self.recent_loss.append(loss)
        self.group_recent.append(norms)

    def _exploded_groups(self, groups: Sequence[str], norms: Sequence[float], limit: float,
                         most: int = 8) -> list[dict[str, Any]]:
        """The groups whose own norm jumped past the limit, largest jump first."""
        jumps = []
        for i, (name, norm) in enumerate(zip(groups, norms)):
            logged = log_norm(norm)
            # (a group added since a step has no norm in it)
            seen = [v for v in (log_norm(step[i] if i < len(step) else None) for step in self.group_recent)
                    if v is not None]
            if logged is None or not seen:
                continue
            rise = logged - statistics.median(seen)
            if rise > limit:
                jumps.append((rise, name, norm))
        jumps.sort(reverse=True)
        return [{"group": name, "grad_norm": norm, "ratio": 10 ** rise} for rise, name, norm in jumps[:most]]


CALM_FACTOR = 1.25  # a loss level within this of the lowest is the run before its climb


class LossClimb:
    """A loss that climbs back past where the run started, over several steps, the gradient norm rising with it.

    One event per climb: after it, a fresh window of steps must show the level back within bounds before
    another climb counts (a rewind restores a lower loss; a run left diverged stays one event).
    """

    def __init__(self, settings: DivergenceSettings | None = None):
        self.settings = settings or DivergenceSettings()
        self.losses = RollingMedian(self.settings.climb_window)
        self.norms = RollingMedian(self.settings.climb_window)
        self.start: float | None = None  # the first level: where the run started
        self.low: tuple[int, float, float] | None = None  # (step, loss level, grad-norm level) at its lowest
        self.climbing = False
        self.calm = 0  # the last step whose level was still near the lowest: the climb began after it

    def update(self, step: int, loss: float | None, total: float) -> dict[str, Any] | None:
        if loss is None or not math.isfinite(loss) or loss <= 0 or not math.isfinite(total) or total <= 0:
            return None  # (a loss at or below 0 has no factor to climb by; non-finite steps are the NaN watch's)
        self.losses.append(loss)
        self.norms.append(total)
        s = self.settings
        if len(self.losses) < s.climb_window:
            return None
        level, norm_level = self.losses.median(), self.norms.median()
        if self.start is None:
            self.start = level
        if self.low is None or level < self.low[1]:
            self.low = (step, level, norm_level)
        low_step, low, low_norm = self.low
        if level <= CALM_FACTOR * low:
            self.calm = step
        climbed = level >= s.climb_factor * low and level - low >= s.climb_nats and level > self.start \
            and norm_level >= s.climb_grad_factor * low_norm
        if not climbed:
            self.climbing = False
            return None
        if self.climbing:
            return None
        self.climbing = True
        self.losses, self.norms = RollingMedian(s.climb_window), RollingMedian(s.climb_window)
        return {"total_grad_norm": total, "loss": loss, "began_at_step": self.calm + 1,
                "loss_climb": {"from_step": low_step, "low_loss_level": low, "loss_level": level,
                               "start_loss_level": self.start, "loss_ratio": level / low,
                               "grad_norm_level": norm_level, "grad_norm_ratio": norm_level / low_norm,
                               "window": s.climb_window}}


def climb_message(evidence: dict[str, Any]) -> str:
    climb = evidence["loss_climb"]
    return (f"the loss climbed from {climb['low_loss_level']:.4g} (median of {climb['window']} steps, at step "
            f"{climb['from_step']}) to {climb['loss_level']:.4g}, past where the run started "
            f"({climb['start_loss_level']:.4g}), the gradient norm {climb['grad_norm_ratio']:.2g}x with it: "
            "the run is unlearning (a learning rate too high for it)")


class DeadRunDetector:
    """Steps that cannot learn: every gradient exactly 0, or the loss bit-identical to the last step's.

    A learning rate far too high saturates the model in one step (the logits go flat: a loss of
    ln(vocab) for ever, gradient 0) while AdamW's momentum keeps moving the weights, so the frozen-
    weights check never fires. A zero loss is left out of the bit-identical test (GRPO logs 0 on
    every healthy first inner step); ``zero_grad_expected`` leaves zero gradients to a more specific
    detector (a GRPO step whose groups all have equal rewards has no advantage, so no gradient).
    """

    def __init__(self, settings: DivergenceSettings | None = None, zero_grad_expected: bool = False):
        self.settings = settings or DivergenceSettings()
        self.zero_grad_expected = zero_grad_expected
        self.streak = 0
        self.start: int | None = None
        self.last_loss: float | None = None
        self.reasons: set[str] = set()
        self.reported = False

    def update(self, step: int, loss: float | None, total: float | None,
               explosion_step: int | None = None) -> dict[str, Any] | None:
        zero = total == 0.0 and not self.zero_grad_expected
        constant = loss is not None and loss == self.last_loss and loss != 0.0 and math.isfinite(loss)
        self.last_loss = loss
        if not (zero or constant):  # a healthy step (every step of a healthy run: no set built)
            if self.streak:
                self.streak, self.start, self.reasons, self.reported = 0, None, set(), False
            return None
        reasons = {"zero-gradient"} if zero else set()
        if constant:
            reasons.add("constant-loss")
        if self.streak == 0:
            # a bit-identical loss shows on the second step of the stretch: it began on the one before
            self.start = step - 1 if reasons == {"constant-loss"} else step
        self.streak += 1
        self.reasons |= reasons
        if self.reported or self.streak < self.settings.dead_after:
            return None
        self.reported = True
        evidence: dict[str, Any] = {"dead_since_step": self.start, "began_at_step": self.start,
                                    "steps_dead": step - (self.start or 0) + 1,
                                    "zero_gradient": "zero-gradient" in self.reasons,
                                    "constant_loss": loss if "constant-loss" in self.reasons else None,
                                    "total_grad_norm": total, "loss": loss}
        if explosion_step is not None:
            evidence["after_explosion_at_step"] = explosion_step
        return evidence


def dead_run_message(evidence: dict[str, Any]) -> str:
    what = []
    if evidence.get("zero_gradient"):
        what.append("the gradient norm is exactly 0")
    if evidence.get("constant_loss") is not None:
        what.append(f"the loss is constant at {evidence['constant_loss']!r}")
    text = f"the run stopped learning at step {evidence['dead_since_step']}: " + " and ".join(what)
    text += f" for {evidence['steps_dead']} steps"
    if evidence.get("after_explosion_at_step") is not None:
        text += f", after the gradient exploded at step {evidence['after_explosion_at_step']}"
    return text


def divergence_message(evidence: dict[str, Any]) -> str:
    overflow = evidence.get("fp32_norm_overflow")  # finite gradients: only their fp32 norm overflowed
    bound = "at least " if overflow is not None and overflow["lower_bound"] else ""
    text = f"gradient norm exploded to {bound}{evidence['total_grad_norm']:.3g}"
    if overflow is not None:
        largest = overflow["max_abs_grad"]
        text += " (past fp32's range, every gradient finite" + (
            f": the largest {largest:.3g})" if largest is not None else ")")
    if evidence.get("ratio") is not None:
        text += (f", {evidence['ratio']:.3g}x the run's recent level ({evidence['decades_above_level']:.1f} decades; "
                 f"the run's own noise allows {evidence['threshold_decades']:.1f})")
    if evidence.get("loss") is not None and evidence.get("recent_loss_median") is not None:
        text += f"; loss {evidence['loss']:.4g} (recent median {evidence['recent_loss_median']:.4g})"
    groups = evidence.get("exploded_groups") or []
    if groups:
        text += f"; largest jump in {groups[0]['group']}"
    return text


RUN_FIXES = ["lower-learning-rate", "add-warmup", "enable-grad-clipping"]


class RunHealth:
    """Divergence (an explosion or a climb) and dead runs over one watch's steps: what the sentinel read.

    ``zero_grad_expected`` / ``ln2_expected``: on TRL's RL and preference stacks a zero gradient (a
    GRPO generation with no reward spread) or a DPO loss at ln 2 are what their own checks explain
    better, so the dead-run check leaves them to those.
    """

    def __init__(self, settings: DivergenceSettings | None = None, zero_grad_expected: bool = False,
                 constant_expected: float | None = None, loss_climbs: bool = True):
        self.divergence = DivergenceDetector(settings)
        # (an RL or preference loss is no measure of learning: GRPO's starts at 0, DPO's at ln 2)
        self.climb = LossClimb(settings) if loss_climbs else None
        self.dead = DeadRunDetector(settings, zero_grad_expected=zero_grad_expected)
        self.constant_expected = constant_expected

    def update(self, step: int, loss: float | None, groups: Sequence[str], norms: Sequence[float],
               total: float | None = None, overflow: dict[str, Any] | None = None) -> list[tuple[str, str, dict]]:
        """``norms[i]``: the gradient norm of ``groups[i]``; ``total``: their 2-norm, where the caller has it;
        ``overflow``: finite gradients whose fp32 norm overflowed (the sentinel's ``norm_overflow``)."""
        if total is None:
            total = math.sqrt(sum(v * v for v in norms))
        found = []
        exploded = self.divergence.update(step, loss, total, groups, norms, overflow)
        if exploded is not None:
            found.append(("divergence", divergence_message(exploded), exploded))
        climbed = self.climb.update(step, loss, total) if self.climb is not None else None
        if climbed is not None and exploded is None and not self.divergence.exploding:
            found.append(("divergence", climb_message(climbed), climbed))
        explained = loss is not None and self.constant_expected is not None and \
            abs(loss - self.constant_expected) < 1e-6
        dead = self.dead.update(step, None if explained else loss, total, self.divergence.last_explosion)
        if dead is not None:
            found.append(("dead-run", dead_run_message(dead), dead))
        return found
