"""The watch's state and its record: events, listeners, internal failures, localised events, results.

:class:`WatchRecord` is the base of :class:`~nbguard.watcher.core.watch.NanWatch`. It declares the state
every part of the watch shares (``NanWatch.__init__`` sets it) and records what the watch finds:
``emit`` (the verifier first, then the listeners), ``_fail`` (a watch-error event, then the watch
steps aside), the events localised by replay (:class:`~nbguard.watcher.localise.events.Localiser`, agreed
across ranks), and the summary and document. The parts above it: :mod:`.steps` (the step state
machine and the policy), :mod:`.lifecycle` (attach and detach), :mod:`.watch` (construction and the
interface integrations use).
"""
from __future__ import annotations

import contextlib
import functools
import traceback
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ...document.outward import outward_text, warn
from ...document.view import plural
from ...findings import Event, document
from ...step.capture import MicroBatch
from ..detectors.thresholds import WatchSettings
from ..distributed import ranks
from ..integrations.loop import OptimizerBinding, ScalerBinding
from ..localise.events import Localiser, fold_skip_streaks, skip_streaks
from ..localise.rows import name_rows
from ..reads.activations import ActivationProbe
from ..reads.history import ActivationHistory, GradHistory
from ..reads.sentinel import GradNormCollector, StepStats
from .guard import guarded_call
from .pipeline import DetectorBoard, StepView

Listener = Callable[[Any, str, Any], None]  # callback(watch, kind, payload)


class WatchRecord(ABC):
    # ---- the configuration (NanWatch.__init__) --------------------------------------------
    target: Any  # the model or Trainer the user passed
    trainer: Any  # the Trainer, else None
    model: torch.nn.Module  # the module hooked and replayed (a DDP wrapper's inner module)
    optimizer: torch.optim.Optimizer | None
    scaler: Any  # the GradScaler the loop uses, else None
    policy: str
    localize: bool
    settings: WatchSettings
    watch_id: str  # stable identity across displays: merged notebook outputs keep only the latest view
    # verifier(watch, event) for the first localised non-finite event: nbguard.watch passes
    # nbguard.verifier.auto_verify (which runs the fixes on a shadow of the step) unless verify=False
    _verifier: Callable[[Any, Event], None] | None
    verification: Any  # the Verification it left
    _kept_step: tuple[Event, Any] | None  # (event, CapturedStep) that nbguard.verify(event) reuses
    # ---- what the watch reads and keeps -----------------------------------------------------
    _collector: GradNormCollector
    history: GradHistory
    _probe: ActivationProbe | None
    activation_history: ActivationHistory | None  # None unless activations=True
    _board: DetectorBoard
    config: Any  # each component's settings (config.WatchConfig)
    _context: Any  # what components may use of the watch (context.WatchContext)
    _localiser: Localiser
    events: list[Event]
    step: int
    _listeners: list[Listener]
    # ---- across ranks -----------------------------------------------------------------------
    _ranks: ranks.RankSync | None  # multi-rank runs: one small collective per step, folded into the read
    _bucket_reader: Any  # DDP: the communication hook reading this rank's buckets (ddp_buckets.BucketReader)
    _verdict: ranks.RankVerdict | None
    _rank_tokens: Any  # do the ranks' losses weigh their tokens alike? (rank_tokens.RankTokenBalance)
    _streamer: Any  # a forked rank's stream to the kernel (stream.RankStreamer)
    _keep_farewell: bool
    # ---- attachment -------------------------------------------------------------------------
    attached: bool
    _handles: list
    _modules_seen: weakref.WeakSet
    _coverage_stale: bool
    _opt_binding: OptimizerBinding | None
    _scaler_binding: ScalerBinding | None
    _callback: Any  # WatchCallback, Trainer only
    _labels_tap: Any  # LabelsTap, Trainer only: labels the Trainer keeps from the model
    _loss_tap: Any  # TrainingLossTap: a Trainer whose loss is not its model's own
    _deepspeed: Any  # DeepSpeed's skips, from its engine or its log lines, read when deepspeed is imported
    _trainer_control: Any
    _stop_requested: bool
    _rewinder: Any  # policy rewind: its snapshots (rewind.Rewinder), else None
    _rows: Any  # the dataset indices of each captured micro-batch (rows.RowTracker), else None
    _rows_named: int  # bad steps whose rows were named (a budget like the replays')
    _broken: bool
    _replaying: bool
    # ---- the current step -------------------------------------------------------------------
    _bad_streak: int
    _micro_batches: list[MicroBatch]
    _losses: list[torch.Tensor]  # the model's output loss or the Trainer's, per micro-batch
    _backward_roots: list[torch.Tensor]  # the scalars backward() started from through the model
    _backward_binding: Any  # BackwardRoots while attached
    _stats: StepStats | None
    _step_view: StepView | None  # this step's view for the detectors, once built
    _optimizer_stepped: bool
    _step_dropped: bool
    _forward_open: bool  # a training forward started and has not returned
    # ---- read="deferred" (reads/deferred.py): a step judged a step late ---------------------------
    _parked: Any  # ParkedStep: the step whose numbers are on their way to the host
    _forward_traced: bool  # torch.compile traced the watched module's forward since the last step
    _traced_said: bool
    _queued_micro_batches: list[MicroBatch]  # the components hear of these after the parked step is judged
    _gathered: Any  # this step's numbers stacked on the device (sentinel.Gathered), until it is parked
    _late_for: Any
    _late: bool
    _judging_late: bool
    _replay_trusted: bool  # False: the judged step's bad update was applied (no replay on what it changed)
    _exploded_on_device: bool  # the judged step's finite update was dropped on the device as a divergence
    _pending_replaced: bool
    _device_skip: Any
    _mirror: Any

    @abstractmethod
    def detach(self) -> Any:
        """Remove every hook (:mod:`.lifecycle`); the watch steps aside through it."""

    # ---- events and listeners ------------------------------------------------------------------------
    def emit(self, event: Event) -> None:
        """Record an event (an integration's own, e.g. DeepSpeed's skipped steps): listeners see it."""
        if not isinstance(event, Event):
            raise TypeError(f"emit(event) takes an nbguard Event, got {type(event).__name__}")
        self._emit(event)

    def _emit(self, event: Event, agreed: bool = False) -> None:
        if self._ranks is not None and not agreed and event.rank is None:
            event.rank = self._ranks.rank  # this rank's own event (an agreed one names its origin rank)
        if self._verifier is not None and self._kept_step is None and self._replay_trusted:
            self._verifier(self, event)  # first, so listeners see the event with its verdicts
        self.events.append(event)
        self._notify("event", event)

    def add_listener(self, callback: Listener) -> None:
        """``callback(watch, kind, payload)`` on every step end ("step") and event ("event")."""
        if not callable(callback):
            raise TypeError("add_listener(callback): callback must be callable as callback(watch, kind, payload)")
        if callback not in self._listeners:
            self._listeners.append(callback)

    def remove_listener(self, callback: Listener) -> None:
        if callback in self._listeners:
            self._listeners.remove(callback)

    def _notify(self, kind: str, payload: Any) -> None:
        for callback in list(self._listeners):  # a broken dashboard must not break training
            guarded_call(functools.partial(self._drop_listener, callback), callback, self, kind, payload)

    def _drop_listener(self, callback: Listener, exc: BaseException) -> None:
        self.remove_listener(callback)
        self._emit(Event("watch-error", self.step, f"a watch listener failed and was removed: "
                         f"{type(exc).__name__}: {exc}", evidence={"listener": repr(callback)}))

    # ---- failure handling ----------------------------------------------------------------------------
    def _fail(self, exc: BaseException, safe: bool) -> None:
        """Record an internal error and step aside; removal waits for a point where it is safe
        (not while torch iterates the optimizer's hook dicts or the Trainer its callbacks)."""
        if self._broken:
            return
        self._broken = True
        if self._ranks is not None:
            self._ranks.owes_farewell = True
        # a broken watch keeps its hooks until a safe point (its next forward, or never if the loop
        # has ended), but not torch's clip function: that one is global, every later run would pay it
        guarded_call(lambda _: None, self._collector.release_clip)
        self._emit(Event("watch-error", self.step,
                         f"nbguard's watch hit an internal error and detached itself; training goes on: "
                         f"{type(exc).__name__}: {exc}",
                         evidence={"exception": repr(exc), "traceback": traceback.format_exc(limit=6)}))
        try:
            warn(f"nbguard watch detached after an internal error: {exc!r}", RuntimeWarning, stacklevel=2)
        except Exception:  # warnings turned into errors (-W error, pytest): the event above is the record
            pass
        if safe:
            self._step_aside()

    def _step_aside(self) -> None:
        """The watch's own detach after an internal error: across ranks it keeps the step hook that
        joins the next exchange once more (flagged as leaving), so no peer waits in a collective."""
        self._keep_farewell = True
        try:
            self.detach()
        finally:
            self._keep_farewell = False

    # ---- whether hooks do their work -----------------------------------------------------------------
    @property
    def active(self) -> bool:
        """Attached and not stepped aside after an internal error: hooks do their work."""
        return self.attached and not self._broken

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Forward/backward passes inside are not the user's training (a replay, a shadow step):
        no micro-batch capture, no gradient norms. Nests, and restores on any exception."""
        saved = self._replaying, self._collector.enabled
        self._replaying, self._collector.enabled = True, False
        try:
            yield
        finally:
            self._replaying, self._collector.enabled = saved

    # ---- localised events ----------------------------------------------------------------------------
    def _localised_event(self, kind: str, stats: StepStats, extra: dict | None = None,
                         budget: str = "nonfinite") -> Event:
        """This step's event (localised by replay where ``localize`` and the budget allow), or across
        ranks the agreed event: the bad ranks localise, all get the same."""
        def make(replay: bool = True) -> Event:
            return self._localiser.event(kind, self.step, stats, self.history.groups, self._micro_batches, extra,
                                         budget, replay=replay and self.localize and self._replay_trusted)

        if self._ranks is None or self._verdict is None:
            event = make()
            if not self._replay_trusted:
                event.evidence["not_replayed"] = ("read a step late (read='deferred') under a policy that keeps bad "
                                                  "updates: the update had changed the weights the replay would run on")
            if kind in ("nonfinite-loss", "nonfinite-grad", "scaler-skip") and self.localize and self._replay_trusted:
                guarded_call(lambda exc: event.evidence.update(rows_error=f"{type(exc).__name__}: {exc}"),
                             self._name_rows, event)
            return event
        sync = self._ranks
        return ranks.agreed_event(sync, self._verdict, self.step, lambda: make(replay=not sync.sharded))

    def _name_rows(self, event: Event) -> None:
        """The rows that broke this step, by dataset index where the loader is followed (:mod:`.rows`)."""
        if not self._micro_batches or self._rows_named >= self.settings.max_replays \
                or event.cause == "no-supervised-tokens":
            return
        self._rows_named += 1
        with self.paused():
            name_rows(event, self.model, self._micro_batches, self._rows)

    # ---- results -------------------------------------------------------------------------------------
    def summary(self) -> str:
        skipped = len(self.history.skipped_steps)
        lines = [f"nbguard watch ({'attached' if self.attached else 'detached'}, policy={self.policy}): "
                 f"{plural(self.step, 'optimizer step')}, {skipped} skipped, {plural(len(self.events), 'event')}"]
        for e, last, count in fold_skip_streaks(self.events):
            if count > 1:
                lines.append(f"  steps {e.step}-{last} [{e.kind}] x{count}: {e.message}")
            else:
                lines.append(f"  step {e.step} [{e.kind}] {e.message}")
        return "\n".join(lines)

    def to_document(self) -> dict[str, Any]:
        sections: dict[str, Any] = {"events": [e.to_dict() for e in self.events], "history": self.history.to_dict()}
        if self.activation_history is not None:
            sections["activations"] = self.activation_history.to_dict()
        streaks = skip_streaks(self.events)
        if streaks:
            sections["skip_streaks"] = streaks
        title = "nbguard NaN/Inf watch"
        if self._ranks is not None:
            title += f" (rank {self._ranks.rank} of {self._ranks.world_size})"
        return document("watch", title=title, watch_id=self.watch_id, **sections)

    def __repr__(self) -> str:
        return outward_text(f"<NanWatch {type(self.target).__name__} policy={self.policy} step={self.step} "
                            f"events={len(self.events)} {'attached' if self.attached else 'detached'}>")
