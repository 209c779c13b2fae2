"""Policy ``rewind``: go back to the last good state instead of losing the run.

Skip drops one bad update; a run whose weights or optimizer moments already carry the damage (an LR
blow-up, a spike that inflated AdamW's second moments, weights already inf) stays lost. Under
``policy="rewind"`` the watch keeps snapshots of everything an update changes (the trainable
parameters, the optimizer's state, the GradScaler's scale, the RNG states; the LR scheduler's state
too) every ``every`` optimizer steps, off the accelerator: on CUDA in pinned host buffers filled with
``copy_(non_blocking=True)`` and an event waited on before the buffers are used; on CPU plain copies
into preallocated buffers. Two slots are kept, inside ``budget_bytes``.

On a non-finite, divergence or dead-run (after live steps) event the update is dropped and the last
snapshot taken before the
trouble began (finite, and at least one step before the bad step, since the update just before it
may be the damaging one) is restored IN PLACE (``copy_``: every tensor the user holds stays valid).
Divergence and a dead run also scale the LR (``lr_factor``, on every param group and the scheduler's
``base_lrs``). The data stream moves forward: the batches in between are skipped, not replayed, and
the scheduler keeps its place in the schedule (``schedule="restore"`` puts it back too). A
non-finite step that the replay cannot reproduce is a blip: skipped, not rewound; so is one whose
weights and optimizer state are still finite (its batch was bad: dropping the update undid it), unless
it is the second bad step in a row. After ``max_rewinds`` rewinds the next one stops training with a
message. Each rewind is a ``rewind`` event and a row in the history.

Across ranks (DDP) every rank rewinds alike: the non-finite verdict is already agreed, a snapshot is
taken only where every rank's step was clean (one small collective every ``every`` steps), and the
snapshot restored is the oldest of the ranks' choices (their losses differ). A divergence is one rank's
own verdict there: it is reported, and rewinds nothing.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ...document.outward import warn
from ...findings import Event, register_event_kind
from ...step.capture import capture_rng, restore_rng
from ..core.guard import guarded_call
from ..localise.row_replay import batch_loss

if TYPE_CHECKING:
    from ..core.context import WatchContext

register_event_kind("rewind", "policy rewind restored the last good snapshot (or could not, and said why)",
                    ("restored_after_step", "batches_skipped", "lr_before", "lr_after", "rewinds"))

GIB = 1 << 30
# the events whose cause is an update too large: the LR is cut after their rewind (a run that learned and then
# went dead had its logits saturated by one)
LR_CAUSES = ("divergence", "dead-run")
SCHEDULES = ("keep", "restore")


@dataclass
class RewindSettings:
    """How ``policy="rewind"`` keeps and uses its snapshots."""

    every: int = 50  # optimizer steps between snapshots
    budget_bytes: int = 4 * GIB  # host memory for every slot together
    lr_factor: float = 0.5  # the LR is multiplied by this after a divergence
    max_rewinds: int = 3  # then the next trouble stops training
    slots: int = 2  # snapshots kept (the newest may be too recent to trust)
    schedule: str = "keep"  # "keep": the scheduler keeps its place; "restore": it goes back too

    def __post_init__(self) -> None:
        if not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"RewindSettings.every must be a positive number of optimizer steps, got {self.every!r}")
        if not isinstance(self.budget_bytes, (int, float)) or self.budget_bytes < 0:
            raise ValueError(f"RewindSettings.budget_bytes must be a number of bytes >= 0, got {self.budget_bytes!r}")
        if not isinstance(self.lr_factor, (int, float)) or not 0 < self.lr_factor <= 1:
            raise ValueError(f"RewindSettings.lr_factor must be in (0, 1], got {self.lr_factor!r}")
        if not isinstance(self.max_rewinds, int) or self.max_rewinds < 0:
            raise ValueError(f"RewindSettings.max_rewinds must be an int >= 0, got {self.max_rewinds!r}")
        if not isinstance(self.slots, int) or self.slots < 1:
            raise ValueError(f"RewindSettings.slots must be an int >= 1, got {self.slots!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"RewindSettings.schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")


def unwrap_scheduler(scheduler: Any) -> Any:
    """The torch LR scheduler inside wrappers such as accelerate's ``AcceleratedScheduler``."""
    for _ in range(4):
        inner = getattr(scheduler, "scheduler", None)
        if inner is None or inner is scheduler or not hasattr(inner, "state_dict"):
            break
        scheduler = inner
    return scheduler


def _trainable(model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """The tensors an update moves: the optimizer's parameters (without one, the model's trainable ones;
    walking a PEFT model's modules costs more than copying its adapters)."""
    if optimizer is None:
        return [p for p in model.parameters() if p.requires_grad] if model is not None else []
    seen: set[int] = set()
    out: list[torch.Tensor] = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def _live_tensors(model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None,
                  scaler: Any) -> tuple[dict[tuple, torch.Tensor], dict[tuple, Any]]:
    """Everything an update changes, by a key that survives the optimizer replacing its state
    tensors: ("param", i), ("state", i, name), ("scaler", name). Returns (tensors, plain values)."""
    params = _trainable(model, optimizer)
    tensors: dict[tuple, torch.Tensor] = {("param", i): p for i, p in enumerate(params)}
    plain: dict[tuple, Any] = {}
    if optimizer is not None:
        for i, p in enumerate(params):
            for name, value in optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    tensors[("state", i, name)] = value
                else:
                    plain[("state", i, name)] = copy.deepcopy(value)
    if scaler is not None and getattr(scaler, "is_enabled", lambda: False)():
        for name in ("_scale", "_growth_tracker"):
            value = getattr(scaler, name, None)
            if isinstance(value, torch.Tensor):
                tensors[("scaler", name)] = value
    return tensors, plain


def estimate_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
    """One snapshot's size before the optimizer has state: the trainable parameters and, per
    parameter, the moments the optimizer will keep (Adam-like: 2; with momentum: 1; unknown: 2)."""
    params = _trainable(model, optimizer)
    size = sum(p.numel() * p.element_size() for p in params)
    if optimizer is None:
        moments = 2  # a Trainer makes its optimizer inside train(): assume AdamW, its default
    elif "betas" in optimizer.defaults:
        moments = 2
    elif optimizer.defaults.get("momentum"):
        moments = 1
    else:
        moments = 0
    return size * (1 + moments)


class Snapshot:
    """One slot: preallocated host buffers for the live tensors, refilled in place each time."""

    def __init__(self) -> None:
        self.buffers: dict[tuple, torch.Tensor] = {}
        self.layout: list[tuple] = []  # (key, shape, dtype, device) of each live tensor, in order
        self.by_device: dict[torch.device, list[torch.Tensor]] = {}
        self.plain: dict[tuple, Any] = {}
        self.after_step: int | None = None  # the state after this step's update
        self.scheduler: dict | None = None
        self.lr: list[float] | None = None  # the param groups' LR when it was taken
        self.rng: dict[str, Any] | None = None
        self.ready: Any = None  # a torch.cuda.Event the buffers are valid after
        self.finite: bool | None = None  # checked once, when first used

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    def fits(self, tensors: dict[tuple, torch.Tensor]) -> bool:
        return self.layout == [(k, t.shape, t.dtype, t.device) for k, t in tensors.items()]

    def allocate(self, tensors: dict[tuple, torch.Tensor]) -> None:
        pin = torch.cuda.is_available() and any(t.is_cuda for t in tensors.values())
        self.buffers = {k: torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin and t.is_cuda)
                        for k, t in tensors.items()}
        self.layout = [(k, t.shape, t.dtype, t.device) for k, t in tensors.items()]
        # the buffers in the order of the live tensors, by device: one fused copy per device
        self.by_device = {}
        for key, live in tensors.items():
            self.by_device.setdefault(live.device, []).append(self.buffers[key])

    def fill(self, tensors: dict[tuple, torch.Tensor], plain: dict[tuple, Any], after_step: int,
             scheduler: Any) -> None:
        """Copy ``tensors`` (laid out as at ``allocate``) into the buffers; on CUDA without waiting."""
        self.wait()  # the previous copy into these buffers must be done before they are overwritten
        cuda = False
        with torch.no_grad():
            if len(self.by_device) == 1:
                [(device, buffers)] = self.by_device.items()
                sources_of = {device: list(tensors.values())}
            else:
                sources_of = {}
                for live in tensors.values():
                    sources_of.setdefault(live.device, []).append(live)
            for device, buffers in self.by_device.items():
                cuda = cuda or device.type == "cuda"
                # one fused call per device; under no_grad a parameter needs no detach
                torch._foreach_copy_(buffers, sources_of[device], non_blocking=device.type == "cuda")
        if cuda:
            self.ready = torch.cuda.Event()
            self.ready.record()
        self.plain = plain
        self.after_step = after_step
        self.scheduler = copy.deepcopy(scheduler.state_dict()) if scheduler is not None else None
        self.rng = capture_rng()
        self.finite = None

    def wait(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()
            self.ready = None

    def is_finite(self) -> bool:
        """Every floating buffer finite (checked on the host, once per snapshot, only when it may be used)."""
        if self.finite is None:
            self.wait()
            self.finite = all(bool(torch.isfinite(b).all()) for b in self.buffers.values() if b.is_floating_point())
        return self.finite


@dataclass
class Restored:
    snapshot: Snapshot
    tensors: int
    dropped_state: int  # parameters whose optimizer state did not exist yet at the snapshot
    what: list[str] = field(default_factory=list)


class Rewinder:
    """The snapshots of one watch and what it does on trouble (``NanWatch`` owns one under policy rewind)."""

    def __init__(self, settings: RewindSettings, scheduler: Any = None):
        self.settings = settings
        self.scheduler = scheduler  # a plain loop's (nbguard.watch(..., scheduler=)); a Trainer's is read each time
        self.slots = [Snapshot() for _ in range(settings.slots)]
        self.next_due = 0  # the first step whose end takes a snapshot
        self.rewinds = 0
        # after a divergence rewind that cut the LR, each group's LR is held at most at the restored state's LR x
        # lr_factor for ``every`` steps: a schedule still blown up (x1000 for a few steps) would otherwise do the
        # damage again at once, under the divergence thresholds (a Trainer's run stayed 49% above the healthy one)
        # or into a second rewind. Past that window the hold stays on while the schedule still asks for over
        # SPIKE_FACTOR x the cap (a blow-up longer than the window), at most through ``hold_bound``; released, it is
        # over for good (a warmup later rising past it is not held)
        self.lr_cap: list[float] | None = None
        self.cap_until = -1
        self.hold_bound = -1
        self.held_through = -1  # the last step whose update ran under the hold (a snapshot then records the cap)
        self._held: list[tuple[dict, float]] = []  # (param group, its LR) capped for the update under way
        self.unavailable: str | None = None  # why rewinding is off (then the watch skips instead)
        self.taken = 0  # snapshots taken
        self.history: list[dict[str, Any]] = []

    # ---- at attach: does it fit? -----------------------------------------------------------------------
    def check_budget(self, watch: WatchContext) -> str | None:
        """Why rewinding cannot run for this watch (None: it can): the parameters live where a snapshot
        cannot hold them all (FSDP shards, a DeepSpeed engine's own fp32 copies), or the snapshots do not
        fit the budget."""
        from ..distributed.deepspeed_engine import find_engine

        if watch.ranks is not None and watch.ranks.sharded:
            return ("rewinding sharded (FSDP) parameters is not supported: each rank holds a shard of the weights and "
                    "of the optimizer state")
        if find_engine(watch.model) is not None or getattr(watch.trainer, "is_deepspeed_enabled", False):
            return "rewinding a DeepSpeed engine is not supported: it keeps the fp32 weights in its own buffers"
        need = estimate_bytes(watch.model, watch.optimizer) * self.settings.slots
        if need > self.settings.budget_bytes:
            return (f"{self.settings.slots} snapshots of the trainable parameters and optimizer state need about "
                    f"{need / GIB:.2f} GiB of host memory, over the budget of {self.settings.budget_bytes / GIB:.2f} "
                    f"GiB (RewindSettings(budget_bytes=...)); a full fine-tune rarely fits, LoRA does")
        return None

    def turn_off(self, watch: WatchContext, why: str) -> None:
        """Fall back to skip, saying so once."""
        self.unavailable = why
        for slot in self.slots:
            slot.buffers, slot.layout, slot.by_device = {}, [], {}
        watch.set_policy("skip")
        event = Event("rewind", watch.step, f"policy rewind is off, the watch skips bad updates instead: {why}",
                      evidence={"available": False, "reason": why})
        watch.emit(event)
        try:
            warn(f"nbguard: {event.message}", RuntimeWarning, stacklevel=3)
        except Exception:  # warnings turned into errors: the event is the record
            pass

    def current_scheduler(self, watch: WatchContext) -> Any:
        scheduler = self.scheduler
        if scheduler is None and watch.trainer is not None:
            scheduler = getattr(watch.trainer, "lr_scheduler", None)
        return unwrap_scheduler(scheduler) if scheduler is not None else None

    # ---- at a step's end: a snapshot every ``every`` healthy steps ------------------------------------
    def step_ended(self, watch: WatchContext, step: int, skipped: bool, found: list) -> None:
        if self.unavailable is not None or watch.policy != "rewind":
            return
        sync = watch.ranks
        late = next((e for _, e in found if e.kind == "divergence" and not e.evidence.get("update_dropped")), None)
        if late is not None and sync is None:  # judged at the step's end (an enabled GradScaler): rewind now
            late.evidence["update_dropped"] = False
            self.respond(watch, late, step, step_ended=True)
            return
        if skipped or step < self.next_due or watch.optimizer is None:
            return
        # anything seen on this step: not a state to come back to
        clean = not found and not any(e.step == step and e.kind != "rewind" for e in watch.events[-4:])
        if sync is not None:  # every rank's step clean, or no rank keeps it: the ranks' snapshots stay alike
            clean = bool(sync.smallest(int(clean), watch.device()))
        if clean:
            self.take(watch, step)

    def take(self, watch: WatchContext, step: int) -> None:
        tensors, plain = _live_tensors(watch.model, watch.optimizer, watch.scaler)
        slot = self.slot_to_fill(watch)
        if not slot.fits(tensors):
            others = sum(s.nbytes for s in self.slots if s is not slot)
            need = sum(t.numel() * t.element_size() for t in tensors.values())
            if others + need > self.settings.budget_bytes or need * len(self.slots) > self.settings.budget_bytes:
                self.turn_off(watch, f"a snapshot takes {need / GIB:.2f} GiB; {len(self.slots)} of them are over "
                                     f"the budget of {self.settings.budget_bytes / GIB:.2f} GiB")
                return
            slot.allocate(tensors)
        slot.fill(tensors, plain, step, self.current_scheduler(watch))
        slot.lr = self.lr_ran_at(watch, step)
        self.taken += 1
        self.next_due = step + self.settings.every

    def slot_to_fill(self, watch: WatchContext) -> Snapshot:
        """The oldest slot, unless its state had the lower loss: a run whose loss has risen since (a slow climb
        to an LR too high) keeps its best state to come back to, and refills the newer slot. Across ranks,
        always the oldest (their losses differ, and every rank's slots must hold the same steps)."""
        by_age = sorted(self.slots, key=lambda s: -1 if s.after_step is None else s.after_step)
        oldest, newer = by_age[0], by_age[-1]
        if watch.ranks is not None or oldest.after_step is None or newer.after_step is None:
            return oldest
        losses = dict(zip(watch.history.steps, watch.history.loss))
        old_level, new_level = _loss_level(losses, oldest.after_step), _loss_level(losses, newer.after_step)
        if old_level is not None and new_level is not None and new_level > ROSE_SINCE_FACTOR * old_level:
            return newer
        return oldest

    # ---- on trouble ------------------------------------------------------------------------------------
    def choose(self, bad_step: int, history: Any = None) -> Snapshot | None:
        """The newest snapshot taken at least one step before the bad step (the update just before it may
        be the one that did the damage) whose values are finite and whose weights gave a loss in line
        with the steps before it (a damaging update can show a step or two before an event)."""
        usable = sorted((s for s in self.slots if s.after_step is not None and s.after_step <= bad_step - 2),
                        key=lambda s: -(s.after_step or 0))
        losses = dict(zip(history.steps, history.loss)) if history is not None else {}
        return next((s for s in usable if s.is_finite() and not _loss_rose_after(losses, s.after_step or 0)), None)

    def agreed(self, watch: WatchContext, snapshot: Snapshot | None) -> Snapshot | None:
        """Across ranks, the snapshot every rank goes back to: the oldest of the ranks' choices (each judged
        its own losses; their snapshots were taken at the same steps, and hold the same weights)."""
        sync = watch.ranks
        if sync is None:
            return snapshot
        mine = snapshot.after_step if snapshot is not None and snapshot.after_step is not None else -1
        after = sync.smallest(mine, watch.device())
        if after < 0:
            return None
        return next((s for s in self.slots if s.after_step == after), None)

    def respond(self, watch: WatchContext, event: Event | None, step: int, step_ended: bool = False) -> None:
        """The update of ``step`` is already dropped (or, at a step's end, applied): rewind if it helps."""
        if self.unavailable is not None or event is None:
            return
        if event.kind == "divergence" and "rows" not in event.evidence and not step_ended:
            # the rows with the highest losses, while the step's batches are kept (a failure there costs
            # the rows, never the rewind)
            guarded_call(lambda exc: event.evidence.update(rows_error=f"{type(exc).__name__}: {exc}"),
                         watch.name_rows, event)
        nonfinite = event.kind in ("nonfinite-loss", "nonfinite-grad")
        if nonfinite and event.cause == "not-reproducible":
            event.evidence["rewind"] = {"restored": False, "reason": "the replay did not reproduce it: a blip, "
                                        "skipped without rewinding"}
            return
        if nonfinite and watch.bad_streak < 2 and event.cause != "nonfinite-parameter" and _state_finite(watch):
            # the bad values came from this step's batch: dropping its update left nothing to undo, and a
            # rewind would throw away the good steps since the snapshot (a second bad step in a row rewinds)
            event.evidence["rewind"] = {"restored": False, "reason": "the weights and optimizer state are still "
                                        "finite: the update was skipped, nothing to undo"}
            return
        watch.forget_bad_streak()  # after a rewind the next bad step is trouble of its own
        # where the trouble began: a streak's first bad step (its event), not the step that ended the patience;
        # a climb's lowest loss, from where it rose
        began = min(step, event.step, event.evidence.get("began_at_step", step))
        snapshot = self.agreed(watch, self.choose(began, watch.history))
        if snapshot is not None and event.kind == "divergence" and not step_ended and watch.ranks is None:
            # (before the most-rewinds stop too: a bad batch is no reason to end the run)
            judged = guarded_call(lambda exc: event.evidence.update(damage_check_error=f"{type(exc).__name__}: {exc}"),
                                  self.judge_damage, watch, snapshot)
            if judged is not None:
                event.evidence["damage_check"] = judged
                if not judged["damaged"]:
                    event.evidence["rewind"] = {
                        "restored": False, "reason": f"the state after step {snapshot.after_step} does no better on "
                        f"this step's batch (loss {judged['snapshot_loss']:.4g}, the current weights "
                        f"{judged['current_loss']:.4g}): the batch exploded, not the weights; its update was dropped, "
                        "nothing to undo"}
                    _blame_the_batch(event, judged)
                    return
        if self.rewinds >= self.settings.max_rewinds:
            last = snapshot
            if last is not None:  # training ends on the last good state, not on the damaged one
                self.restore(watch, last)
                watch.rewound(step)
            kept = f"the state after step {last.after_step} restored" if last is not None else \
                "no snapshot from before the trouble to restore"
            stop = Event("rewind", step, f"rewound {self.rewinds} time(s), the most allowed "
                         f"(RewindSettings(max_rewinds=...)), and the run is in trouble again ({event.kind} at step "
                         f"{event.step}): training stops here, {kept}",
                         evidence={"restored": last is not None, "stopped": True, "rewinds": self.rewinds,
                                   "trigger": event.kind, "max_rewinds": self.settings.max_rewinds,
                                   "restored_after_step": last.after_step if last is not None else None})
            watch.emit(stop)
            watch.request_stop(stop, step_ended=step_ended)
            return
        if snapshot is None:
            event.evidence["rewind"] = {"restored": False, "reason": "no finite snapshot from before the trouble "
                                        "yet: the update was skipped"}
            return
        restored = self.restore(watch, snapshot)
        watch.rewound(step)
        for slot in self.slots:  # taken during the trouble (after the one restored): never come back to them
            if slot.after_step is not None and slot.after_step > (snapshot.after_step or 0):
                slot.after_step = None
        self.next_due = step + 1  # the restored state, once a step shows it healthy, is the next snapshot
        lr_before = [g["lr"] for g in _optimizer(watch).param_groups]
        factor = self.settings.lr_factor if event.kind in LR_CAUSES else 1.0
        if factor != 1.0:
            self.scale_lr(watch, factor)
        lr_after = [g["lr"] for g in _optimizer(watch).param_groups]
        if factor != 1.0 and snapshot.lr:
            self.lr_cap, self.cap_until = [lr * factor for lr in snapshot.lr], step + self.settings.every
            self.hold_bound = self.cap_until + HOLD_MORE_WINDOWS * self.settings.every
        self.rewinds += 1
        skipped = step - (snapshot.after_step or 0)
        evidence: dict[str, Any] = {
            "restored": True, "restored_after_step": snapshot.after_step, "trigger": event.kind,
            "trigger_step": event.step, "batches_skipped": skipped, "lr_factor": factor, "lr_before": lr_before,
            "lr_after": lr_after, "what": restored.what, "rewinds": self.rewinds, "max_rewinds": self.settings.max_rewinds}
        if self.lr_cap is not None and step <= self.cap_until:
            evidence["lr_held"] = {"at_most": list(self.lr_cap), "through_step": self.cap_until,
                                   "longer_while_schedule_over": [cap * SPIKE_FACTOR for cap in self.lr_cap],
                                   "at_latest_through_step": self.hold_bound}
        event.evidence["rewind"] = evidence
        lr_text = f"; lr x{factor:g} ({_lrs(lr_before)} -> {_lrs(lr_after)})" if factor != 1.0 else "; lr unchanged"
        if "lr_held" in evidence:
            lr_text += (f", at most {_lrs(self.lr_cap or [])} through step {self.cap_until} (longer while the schedule "
                        f"asks for over {SPIKE_FACTOR:g}x that, at most through step {self.hold_bound})")
        message = (f"rewound to the state after step {snapshot.after_step} ({event.kind} at step {event.step}): "
                   f"restored {', '.join(restored.what)}; {skipped} batch(es) skipped{lr_text}; rewind "
                   f"{self.rewinds} of {self.settings.max_rewinds}")
        self.history.append({"step": step, "restored_after_step": snapshot.after_step, "batches_skipped": skipped,
                             "lr_factor": factor, "trigger": event.kind})
        watch.history.record_rewind(self.history[-1])
        watch.emit(Event("rewind", step, message, evidence=evidence))

    def judge_damage(self, watch: WatchContext, snapshot: Snapshot) -> dict[str, Any] | None:
        """Whether the weights are damaged, asked of the batch at hand: its loss on the current weights and on
        the snapshot's (swapped in and out one tensor at a time; the optimizer state is not touched). A batch
        the old state handles no better is the batch's trouble (new, harder or poisoned rows), not damage.
        None where the step's batches cannot be replayed."""
        micro_batches = list(watch.micro_batches)
        if not micro_batches:
            return None
        snapshot.wait()
        pairs = [(live, snapshot.buffers[("param", i)]) for i, live in enumerate(_trainable(watch.model, watch.optimizer))
                 if ("param", i) in snapshot.buffers and snapshot.buffers[("param", i)].shape == live.shape]
        swapped: list[tuple[torch.Tensor, torch.Tensor]] = []
        with watch.paused():
            current = batch_loss(watch.model, micro_batches)
            try:
                for pair in pairs:
                    _swap(*pair)
                    swapped.append(pair)
                old = batch_loss(watch.model, micro_batches)
            finally:  # the current weights back, and the snapshot's back in its buffers: every pair swapped
                for pair in swapped:
                    _swap(*pair)
        if current is None or old is None or not math.isfinite(old):
            return None
        damaged = not math.isfinite(current) or current > SUSPECT_LOSS_FACTOR * old
        return {"current_loss": current, "snapshot_loss": old, "snapshot_after_step": snapshot.after_step,
                "damaged": damaged}

    def restore(self, watch: WatchContext, snapshot: Snapshot) -> Restored:
        """Put the snapshot back in place: ``copy_`` into the live tensors, so references stay valid."""
        snapshot.wait()
        optimizer = watch.optimizer
        params = _trainable(watch.model, optimizer)
        tensors, _ = _live_tensors(watch.model, optimizer, watch.scaler)
        copied = 0
        with torch.no_grad():
            for key, live in tensors.items():
                saved = snapshot.buffers.get(key)
                if saved is not None and saved.shape == live.shape:
                    live.copy_(saved, non_blocking=live.is_cuda)
                    copied += 1
        dropped = 0
        if optimizer is not None:
            had_state = {key[1] for key in snapshot.buffers if key[0] == "state"} | \
                        {key[1] for key in snapshot.plain if key[0] == "state"}
            for i, p in enumerate(params):
                if i not in had_state and optimizer.state.get(p):
                    del optimizer.state[p]  # no state then: the optimizer starts it afresh
                    dropped += 1
            for (kind, i, name), value in snapshot.plain.items():
                if kind == "state" and i < len(params) and p_state(optimizer, params[i]) is not None:
                    optimizer.state[params[i]][name] = copy.deepcopy(value)
        what = [f"{len(params)} trainable tensor(s)"]
        if optimizer is not None:
            what.append("optimizer state")
        if any(key[0] == "scaler" for key in snapshot.buffers):
            what.append("GradScaler scale")
        scheduler = self.current_scheduler(watch)
        if scheduler is not None and snapshot.scheduler is not None and self.settings.schedule == "restore":
            scheduler.load_state_dict(copy.deepcopy(snapshot.scheduler))
            if optimizer is not None:
                for group, lr in zip(optimizer.param_groups, snapshot.scheduler.get("_last_lr") or []):
                    group["lr"] = lr
            what.append("LR scheduler")
        if snapshot.rng is not None:
            restore_rng(snapshot.rng)
            what.append("RNG states")
        return Restored(snapshot, copied, dropped, what)

    def hold_lr(self, watch: WatchContext, step: int) -> None:
        """Before an update that goes through: no group's LR above the cap a divergence rewind set. Only for the
        update: ``release_lr`` puts each LR back after it, so a chainable schedule (CosineAnnealingLR computes each
        LR from the last) or a user's own ``lr /= 1000`` goes on from the LR they set, not from the cap."""
        self.release_lr()
        if self.lr_cap is None or not self.holds(watch, step):
            return
        self.held_through = step
        for group, cap in zip(_optimizer(watch).param_groups, self.lr_cap):
            if not isinstance(group["lr"], torch.Tensor) and group["lr"] > cap:
                self._held.append((group, group["lr"]))
                group["lr"] = cap

    def holds(self, watch: WatchContext, step: int) -> bool:
        """Whether this step's update runs under the hold: through ``cap_until``; past it, while some group's LR is
        still over SPIKE_FACTOR x its cap (the schedule's blow-up has not passed: released, it would do the damage
        again and a snapshot taken meanwhile would be rewound to), at most through ``hold_bound``. The first step
        past the window that is not held ends the hold."""
        if step <= self.cap_until:
            return True
        # (a cap of 0, from a snapshot at a warmup's LR 0, measures no spike)
        if step <= self.hold_bound and any(cap > 0 and not isinstance(group["lr"], torch.Tensor)
                                           and group["lr"] > SPIKE_FACTOR * cap
                                           for group, cap in zip(_optimizer(watch).param_groups, self.lr_cap or [])):
            return True
        self.hold_bound = -1
        return False

    def lr_ran_at(self, watch: WatchContext, step: int) -> list[Any]:
        """Each group's LR for a snapshot taken after ``step``: the capped LR where the hold was on for its update
        (not the blown-up schedule's, which a later rewind would hold at and cut from)."""
        lrs = [g["lr"] for g in _optimizer(watch).param_groups]
        if self.lr_cap is None or step > self.held_through:
            return lrs
        return [lr if isinstance(lr, torch.Tensor) else min(lr, cap) for lr, cap in zip(lrs, self.lr_cap)]

    def release_lr(self) -> None:
        """After the update: the LRs ``hold_lr`` capped, as they were."""
        held, self._held = self._held, []
        for group, lr in held:
            group["lr"] = lr

    def scale_lr(self, watch: WatchContext, factor: float) -> None:
        for group in _optimizer(watch).param_groups:
            lr = group["lr"]
            if isinstance(lr, torch.Tensor):
                lr.mul_(factor)
            else:
                group["lr"] = lr * factor
        scheduler = self.current_scheduler(watch)
        base = getattr(scheduler, "base_lrs", None)
        if isinstance(base, list):
            scheduler.base_lrs = [b * factor for b in base]
        last = getattr(scheduler, "_last_lr", None)
        if isinstance(last, list):  # what get_last_lr() says: what the groups now hold
            scheduler._last_lr = [g["lr"] for g in _optimizer(watch).param_groups]


def _optimizer(watch: WatchContext) -> torch.optim.Optimizer:
    """The optimizer a rewind acts on (a rewind happens only at an optimizer step, so there is one)."""
    optimizer = watch.optimizer
    if optimizer is None:
        raise RuntimeError("policy rewind acted without an optimizer bound to the watch")
    return optimizer


def _state_finite(watch: WatchContext) -> bool:
    """Whether every trainable tensor and optimizer state tensor is finite: one stacked reduction per
    device, one host read each (a bad step's path only)."""
    tensors, _ = _live_tensors(watch.model, watch.optimizer, None)
    flags: dict[torch.device, list[torch.Tensor]] = {}
    with torch.no_grad():
        for t in tensors.values():
            if t.is_floating_point():
                flags.setdefault(t.device, []).append(torch.isfinite(t).all())
        return all(bool(torch.stack(found).all()) for found in flags.values())


# after a divergence rewind's hold window, a schedule still asking for over this many times the cap is still blown up
# (x1000 spikes; a warmup cut alike asks for its rise since the restored snapshot, over 10x only from a snapshot in its
# first tenth): the hold goes on, for at most HOLD_MORE_WINDOWS x every steps more
SPIKE_FACTOR = 10.0
HOLD_MORE_WINDOWS = 4
SUSPECT_LOSS_FACTOR = 1.5  # a snapshot whose next loss is this far over the losses before it is not trusted
# a newer snapshot whose loss level is this far over an older one's: the run has been getting worse since (a
# flat run's level moves a few percent between snapshots; a falling one's goes down)
ROSE_SINCE_FACTOR = 1.1


def _loss_rose_after(losses: dict[int, float | None], after_step: int, window: int = 8) -> bool:
    """Whether the loss of the step computed on the snapshot's weights (the next one) was non-finite or
    over 1.5x the median of the losses before it: the update just before the snapshot did damage."""
    following = losses.get(after_step + 1)
    before = sorted(v for step, v in losses.items()
                    if after_step - window < step <= after_step and v is not None and math.isfinite(v))
    if following is None or not before:
        return False
    return not math.isfinite(following) or following > SUSPECT_LOSS_FACTOR * before[len(before) // 2]


def _swap(live: torch.Tensor, buffer: torch.Tensor) -> None:
    """Exchange a live tensor's values with its buffer's, through one tensor-sized temporary."""
    with torch.no_grad():
        held = live.detach().clone()
        live.copy_(buffer)
        buffer.copy_(held)


def _loss_level(losses: dict[int, float | None], after_step: int) -> float | None:
    """The median loss around a snapshot's state: the steps just before it and those computed on its weights."""
    near = sorted(v for step, v in losses.items()
                  if after_step - 1 <= step <= after_step + 2 and v is not None and math.isfinite(v))
    return near[len(near) // 2] if near else None


def p_state(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> dict | None:
    state = optimizer.state.get(p)
    return state if state else None


def _lrs(values: list[Any]) -> str:
    shown = sorted({float(v) for v in values})
    text = ", ".join(f"{v:.3g}" for v in shown[:3])
    return text if len(shown) == 1 else f"[{text}{', ...' if len(shown) > 3 else ''}]"


def _blame_the_batch(event: Event, judged: dict[str, Any]) -> None:
    """The damage check cleared the weights: the event says the batch is the trouble, and offers gradient
    clipping (which bounds what one batch can do) before the learning-rate fixes the run checks put first."""
    event.message += (f"; the state after step {judged['snapshot_after_step']} does no better on this batch (loss "
                      f"{judged['snapshot_loss']:.4g}, now {judged['current_loss']:.4g}): the batch's rows, not the "
                      "weights or the learning rate, are the likely cause")
    fixes = event.evidence.get("fixes")
    if isinstance(fixes, list) and "enable-grad-clipping" in fixes:
        event.evidence["fixes"] = ["enable-grad-clipping"] + [f for f in fixes if f != "enable-grad-clipping"]
