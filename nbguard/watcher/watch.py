"""``NanWatch``: the per-step NaN/Inf watch, its events, history and policies."""
from __future__ import annotations

import contextlib
import functools
import math
import sys
import time
import traceback
import uuid
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..document.view import plural
from ..errors import NonFiniteError
from ..findings import Displayable, Event, document
from ..step.capture import MicroBatch, capture_rng, model_loss
from ..step.precision import capture_autocast
from . import distributed as ranks
from .activations import FP16_LIMIT, ActivationProbe, host_values
from .builtin import builtin_detectors
from .detectors import WatchSettings
from .events import event_message, fold_skip_streaks, skip_streaks
from .guard import guarded_call, watch_hook
from .history import ActivationHistory, GradHistory
from .integrations.loop import OptimizerBinding, ScalerBinding, unwrap_optimizer
from .pipeline import Detector, DetectorBoard, StepView
from .policies import check_policy, drop_update, training_stopper, update_dropper
from .replay import Replayer
from .run_checks import RunChecks
from .scaler_skips import ScalerSkips
from .sentinel import GradNormCollector, StepStats

Listener = Callable[["NanWatch", str, Any], None]


# target -> (a weak reference to) the watch attached to it, so a second watch on the same target
# replaces the first. The value is weak because the watch holds its target: a strong value would
# keep the key alive for ever, and with it the model.
_ATTACHED: weakref.WeakKeyDictionary[Any, weakref.ref[NanWatch]] = weakref.WeakKeyDictionary()


def attached_watch(target: Any) -> NanWatch | None:
    """The watch currently registered on ``target``, if it is still alive."""
    ref = _ATTACHED.get(target)
    return ref() if ref is not None else None


def attached_watches() -> list[NanWatch]:
    """Every watch registered on a target and still alive (a snapshot: attaching or detaching
    while the caller iterates does not change it)."""
    alive = [ref() for ref in list(_ATTACHED.values())]  # the map holds weak references to the watches
    return [w for w in alive if w is not None]


def _is_trainer(obj) -> bool:
    try:
        from transformers import Trainer
    except ImportError:
        return False
    return isinstance(obj, Trainer)


class NanWatch(Displayable):
    """Watches a model (with its optimizer) or a Trainer for non-finite losses and gradients.

    The normal path reads one small tensor per optimizer step; on the first bad step the step is
    replayed eagerly with hooks on every module to name where the NaN/Inf was born.
    ``activations=True`` adds forward hooks on the module groups that record each group's output
    abs-max per step (into the same read) for a heatmap against the fp16 limit.
    """

    def __init__(self, target, *, optimizer=None, scaler=None, policy: str = "warn", localize: bool = True,
                 settings: WatchSettings | None = None, activations: bool = False,
                 verifier: Callable[[NanWatch, Event], None] | None = None,
                 detectors: list[Detector] | tuple[Detector, ...] = (), run_checks: bool = True):
        if not isinstance(detectors, (list, tuple)):
            raise TypeError(f"detectors must be a list of Detector instances, got {type(detectors).__name__}")
        if not isinstance(activations, bool):
            raise TypeError(f"activations must be True or False, got {type(activations).__name__}")
        if not isinstance(run_checks, bool):
            raise TypeError(f"run_checks must be True or False, got {type(run_checks).__name__}")
        if verifier is not None and not callable(verifier):
            raise TypeError(f"verifier must be callable as verifier(watch, event), got {type(verifier).__name__}")
        # verifier(watch, event) for the first localised non-finite event: nbguard.watch passes
        # nbguard.verifier.auto_verify (which runs the fixes on a shadow of the step) unless verify=False
        self._verifier = verifier
        self.verification = None  # the Verification it left
        self._kept_step: tuple[Event, Any] | None = None  # (event, CapturedStep) that nbguard.verify(event) reuses
        self.policy = check_policy(policy)
        # Stable identity across displays: merged notebook outputs keep only the latest view.
        self.watch_id = uuid.uuid4().hex
        self.localize = bool(localize)
        self.settings = settings or WatchSettings()
        self.trainer = None
        if _is_trainer(target):
            self.trainer = target
            self.model = target.model
            optimizer = optimizer if optimizer is not None else target.optimizer
        elif isinstance(target, torch.nn.Module):
            if optimizer is None:
                raise ValueError("nbguard.watch(model) needs the optimizer that trains it: pass optimizer=opt "
                                 "(and scaler=scaler if you use a GradScaler), or pass a Trainer instead")
            self.model = ranks.unwrap_parallel(target)  # DDP: hook and replay the user's module
        else:
            raise TypeError(f"target must be a torch.nn.Module or a transformers Trainer/TRL SFTTrainer, "
                            f"got {type(target).__name__}")
        if optimizer is not None and not isinstance(unwrap_optimizer(optimizer), torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if scaler is not None and not (callable(getattr(scaler, "update", None)) and callable(getattr(scaler, "step", None))
                                       and callable(getattr(scaler, "scale", None))):
            raise TypeError(f"scaler must be a torch.amp.GradScaler (the one whose scaler.step(optimizer) and "
                            f"scaler.update() your loop calls) or None, got {type(scaler).__name__}")
        self.target = target
        self.optimizer = unwrap_optimizer(optimizer) if optimizer is not None else None
        self.scaler = scaler
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self._collector = GradNormCollector(named, lambda exc: self._fail(exc, safe=False), self._grads_scaled)
        self.history = GradHistory(self._collector.groups, self.settings.history_capacity)
        # multi-rank runs: one small collective per step, folded into the read
        self._ranks = ranks.RankSync.detect(self._collector.params, len(self._collector.groups))
        self._collector.per_parameter = self._ranks is not None or ranks.needs_parameter_hooks(target, self._collector.params)
        self._verdict: ranks.RankVerdict | None = None
        self._streamer: Any = None  # a forked rank's stream to the kernel (stream.RankStreamer)
        self._keep_farewell = False
        self._deepspeed: Any = None  # DeepSpeed's skip lines, read when deepspeed is imported
        self._probe: ActivationProbe | None = None
        self.activation_history: ActivationHistory | None = None  # None unless activations=True
        if activations:
            self._probe = ActivationProbe(self.model, self._collector.groups,
                                          lambda m: self.active and self._training_forward(m),
                                          lambda exc: self._fail(exc, safe=False))
            self.activation_history = ActivationHistory(self._probe.groups, self.settings.history_capacity,
                                                        FP16_LIMIT)
        self.events: list[Event] = []
        self.step = 0
        self.attached = False
        self._listeners: list[Listener] = []
        self._replayer: Replayer | None = None
        self._replays = 0  # replays of nonfinite-loss/grad events
        self._skip_replays = 0  # replays of the first step of each GradScaler skip streak (own budget)
        self._handles: list = []
        self._modules_seen: weakref.WeakSet = weakref.WeakSet()
        self._accumulations_at_capture = -1  # the collector's count at this step's last capture
        self._forward_open = False  # a training forward started and has not returned
        self._coverage_stale = False
        self._opt_binding: OptimizerBinding | None = None
        self._scaler_binding: ScalerBinding | None = None
        self._callback: Any = None  # WatchCallback, Trainer only
        self._labels_tap: Any = None  # LabelsTap, Trainer only: labels the Trainer keeps from the model
        self._trainer_control = None
        self._stop_requested = False
        self._broken = False
        self._replaying = False
        self._bad_streak = 0
        # the detectors, in the order they judge a step: the GradScaler's skips, the built-in and the
        # user's (add_detector inserts before the run checks, which stay last)
        scaler_skips = ScalerSkips(self.settings, lambda kind, extra, budget: self._localised_event(
            kind, self._read(), extra, budget))
        self._run_checks = RunChecks(self.trainer, lambda exc: self._fail(exc, safe=False)) if run_checks else None
        self._board = DetectorBoard([scaler_skips, *builtin_detectors(self.settings), *detectors],
                                    last=[self._run_checks] if self._run_checks is not None else [])
        self._micro_batches: list[MicroBatch] = []
        self._losses: list[torch.Tensor] = []
        self._stats: StepStats | None = None
        self._release_step()

    # ---- attach / detach -------------------------------------------------------------------
    def attach(self) -> NanWatch:
        """Register every hook; all or nothing: on any error, everything registered so far is removed."""
        if self.attached:
            return self
        try:
            return self._attach()
        except BaseException:
            self._keep_farewell = False
            self.detach()
            raise

    def _attach(self) -> NanWatch:
        previous = attached_watch(self.target)
        if previous is not None and previous is not self and previous.attached:
            previous.detach()  # never stack two watches' hooks on one model
        self._broken = False
        self._handles = [
            self.model.register_forward_pre_hook(self._root_pre, with_kwargs=True),
            self.model.register_forward_hook(self._root_post, with_kwargs=True),
        ]
        self._collector.attach()
        self._handles += self._watch_registrations()
        if self._probe is not None:
            self._probe.attach()
        if self.optimizer is not None:
            self._opt_binding = OptimizerBinding(self.optimizer, self._pre_step, self._post_step, self._zero_grad)
        if self.scaler is not None:
            self._scaler_binding = self._bind_scaler(self.scaler)
        if self.trainer is not None:
            from .integrations.trainer import LabelsTap, WatchCallback

            self._callback = WatchCallback(self)
            self.trainer.add_callback(self._callback)
            self._labels_tap = LabelsTap(self.trainer)
            if self._run_checks is not None:
                self._run_checks.bind()
            self.attached = True
            self.bind_trainer_step()
        self.attached = True
        _ATTACHED[self.target] = weakref.ref(self)
        from ..session import record_watch

        record_watch(self)
        if "deepspeed" in sys.modules and self._deepspeed is None:
            from .deepspeed_skips import DeepSpeedSkips  # its engine skips steps itself: read its log lines

            self._deepspeed = DeepSpeedSkips(self).attach()
        if self._ranks is not None:
            self._ranks.announce()  # peers check at the first step that every rank watches
        if self._ranks is not None and self._streamer is None:
            from .stream import connect  # a forked rank of a %%nanwatch cell: the kernel shows it live

            self._streamer = connect(self, self._ranks.rank, self._ranks.world_size)
        return self

    def _watch_registrations(self) -> list:
        """torch's global hooks on module/parameter assignment: a module swapped into this model after
        attach (``model.lm_head = nn.Linear(...)``, LoRA added later) is covered from the next forward."""
        self._modules_seen = weakref.WeakSet(self.model.modules())
        watch = weakref.ref(self)  # torch's global hook dict must not keep the watch (and model) alive

        def registered(parent, name, value):
            # Under torch.compile, dynamo traces this hook (transformers slices ModuleLists inside
            # forward, which registers modules): a module made while compiling is a temporary, not a swap.
            if torch.compiler.is_compiling():
                return
            live = watch()
            if live is not None and parent in live._modules_seen:
                live._coverage_stale = True

        module_hooks = torch.nn.modules.module
        return [module_hooks.register_module_module_registration_hook(registered),
                module_hooks.register_module_parameter_registration_hook(registered)]

    @watch_hook(safe=True)
    def _cover_new_parameters(self) -> None:
        """Hook the trainable parameters assigned since attach (before this forward runs)."""
        self._coverage_stale = False
        if self._ranks is not None:
            return  # every rank's read has the same shape, agreed at attach: a swap under DDP is not followed
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        if [id(p) for _, p in named] == [id(p) for p in self._collector.params]:
            return
        new_groups = self._collector.cover(named)
        if new_groups:
            self.history.add_groups(new_groups)
        self._modules_seen = weakref.WeakSet(self.model.modules())

    def detach(self) -> NanWatch:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._collector.detach()
        if self._probe is not None:
            self._probe.detach()
        if not (self._keep_farewell and self._owes_farewell()):
            self._remove_step_bindings()
            if self._ranks is not None:
                self._ranks.owes_farewell = False  # detached by the user: nothing is left to say
        if self._callback is not None and self.trainer is not None:
            self.trainer.remove_callback(self._callback)
            self._callback = None
        if self._labels_tap is not None:
            self._labels_tap.remove()
            self._labels_tap = None
        if self._run_checks is not None:
            self._run_checks.unbind()
        if self._deepspeed is not None:
            self._deepspeed.detach()
            self._deepspeed = None
        self._release_step()
        was_attached, self.attached = self.attached, False
        if attached_watch(self.target) is self:
            del _ATTACHED[self.target]
        if was_attached:
            from ..session import release_watch

            release_watch(self)  # the session keeps this watch's document, not the watch
        return self

    def __del__(self) -> None:
        # Collected while attached (the user deleted the model with the watch on): the session
        # keeps the story for the report. Never raise from a finalizer.
        try:
            if getattr(self, "attached", False):
                from ..session import release_watch

                release_watch(self)
        except Exception:
            pass

    def _step_aside(self) -> None:
        """The watch's own detach after an internal error: across ranks it keeps the step hook that
        joins the next exchange once more (flagged as leaving), so no peer waits in a collective."""
        self._keep_farewell = True
        try:
            self.detach()
        finally:
            self._keep_farewell = False

    def _remove_step_bindings(self) -> None:
        if self._opt_binding is not None:
            self._opt_binding.remove()
            self._opt_binding = None
        if self._scaler_binding is not None:
            self._scaler_binding.remove()
            self._scaler_binding = None

    # ---- ranks: a watch that steps aside still joins one exchange so no peer waits for it --------
    def _owes_farewell(self) -> bool:
        return self._ranks is not None and self._ranks.owes_farewell

    def _farewell(self) -> None:
        if self._ranks is None:
            return
        try:
            self._ranks.farewell(self._collector.device())
        except Exception:  # the process group itself failed: nothing is left to keep matched
            pass
        finally:
            if not self.attached:
                self._remove_step_bindings()

    def _settle_farewell(self) -> None:
        """The watch failed at a step boundary before its part of the step's exchange: pay it now."""
        if self._ranks is not None and self._ranks.owes_farewell and not self._ranks.step_exchanged:
            self._farewell()

    def _peers_left(self, verdict: ranks.RankVerdict) -> None:
        """Another rank's watch stepped aside: step aside here too, at the same step."""
        self._broken = True
        self._emit(Event("watch-error", self.step, f"the watch on rank(s) {verdict.leaving} stepped aside after an "
                         f"internal error; it steps aside on every rank so that no rank waits in a collective",
                         evidence={"leaving_ranks": verdict.leaving}))

    def __enter__(self) -> NanWatch:
        return self.attach()

    def __exit__(self, *exc: object) -> None:
        self.detach()  # exceptions propagate

    # ---- the interface integrations use (Trainer callback, distributed helpers) ---------------
    @property
    def active(self) -> bool:
        """Attached and not stepped aside after an internal error: hooks do their work."""
        return self.attached and not self._broken

    def _active(self) -> bool:
        """The old private spelling of :attr:`active`, kept while branches written against it merge."""
        return self.active

    @property
    def stop_requested(self) -> bool:
        """The stop policy asked the training loop to end (a Trainer ends after this step)."""
        return self._stop_requested

    def begin_training(self, control: Any = None) -> None:
        """A (new) ``Trainer.train()`` starts: forget an earlier stop and whatever an interrupted run
        left (its step's batches, losses, read and bad streak), bind the optimizer and scaler."""
        self._stop_requested = False
        self._bad_streak = 0
        self.begin_step()
        self.bind_trainer_step(control)

    @watch_hook(safe=False)
    def bind_trainer_step(self, control: Any = None) -> None:
        """Keep the Trainer's ``control`` (to end training on ``stop``) and bind the optimizer and
        GradScaler, which the Trainer and accelerate create inside ``train()``."""
        if control is not None:
            self._trainer_control = control
        if self.trainer is None:
            return
        from .integrations.trainer import trainer_scaler

        opt = self.trainer.optimizer
        if opt is not None:
            inner = unwrap_optimizer(opt)
            if self._opt_binding is None or self._opt_binding.optimizer is not inner:
                if self._opt_binding is not None:
                    self._opt_binding.remove()
                self.optimizer = inner
                self._opt_binding = OptimizerBinding(inner, self._pre_step, self._post_step, self._zero_grad)
        scaler = trainer_scaler(self.trainer)
        if scaler is not None and (self._scaler_binding is None or self._scaler_binding.scaler is not scaler):
            if self._scaler_binding is not None:
                self._scaler_binding.remove()
            self.scaler = scaler
            self._scaler_binding = self._bind_scaler(scaler)

    def _bind_scaler(self, scaler: Any) -> ScalerBinding:
        return ScalerBinding(scaler, self._before_scaler_update, self._after_scaler_update, self._take_grad_norms)

    @watch_hook(safe=False)
    def _take_grad_norms(self) -> None:
        """The gradients are about to change in place (unscaled, or stepped): the fused read takes them now."""
        self._collector.take()

    def _grads_scaled(self) -> bool:
        binding = self._scaler_binding
        return binding is not None and self.optimizer is not None and binding.grads_scaled(self.optimizer)

    def record_eval_loss(self, eval_loss: float, global_step: int | None = None) -> None:
        """An evaluation's loss (a plain loop's evaluation): as if the trainer had logged it."""
        self.record_log({"eval_loss": float(eval_loss)})

    @watch_hook(safe=False)
    def record_log(self, logs: dict[str, Any]) -> None:
        """The trainer logged metrics after a step (``Trainer.log``): every detector's ``on_log``."""
        step = max(self.step - 1, 0)  # the optimizer step the metrics are about
        for detector in self._board.detectors:  # the run checks (last) read TRL's rewards, margins, ratios
            for event in detector.on_log(step, dict(logs)):
                self._emit(event)

    # ---- detectors and the public interface integrations use ------------------------------------
    @property
    def detectors(self) -> list[Detector]:
        return list(self._board.detectors)

    def add_detector(self, detector: Detector) -> Detector:
        """Add a detector (see :class:`nbguard.watcher.Detector`); it judges from the next step on."""
        self._board.add(detector)
        return detector

    def emit(self, event: Event) -> None:
        """Record an event (an integration's own, e.g. DeepSpeed's skipped steps): listeners see it."""
        if not isinstance(event, Event):
            raise TypeError(f"emit(event) takes an nbguard Event, got {type(event).__name__}")
        self._emit(event)

    def weight_fingerprint(self) -> torch.Tensor:
        """Per-group sum of the trainable weights' norms, on the device (bit-identical only if they are)."""
        return self._collector.fingerprint()

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

    def captured_step(self, event: Event | None) -> tuple[Event, Any] | None:
        """The (event, CapturedStep) kept for ``nbguard.verify(event)`` (``event=None``: whichever is kept), else None."""
        kept = self._kept_step
        return kept if kept is not None and (event is None or kept[0] is event) else None

    def keep_step(self, event: Event, step: Any) -> None:
        """Keep ``step`` (a CapturedStep built from this step's micro-batches) for ``verify(event)``."""
        self._kept_step = (event, step)

    @property
    def micro_batches(self) -> tuple[MicroBatch, ...]:
        """This step's captured training micro-batches (read-only)."""
        return tuple(self._micro_batches)

    def begin_step(self) -> None:
        """A step starts (the Trainer's ``on_step_begin``): what an interrupted step left is dropped,
        so the new step is judged on its own."""
        if self._micro_batches or self._losses or self._stats is not None:
            self._release_step()

    @watch_hook(safe=False)
    def _zero_grad(self) -> None:
        """Gradients cleared after a backward of this step: the step was abandoned (interrupted)."""
        if self._micro_batches and self._collector.accumulations != self._accumulations_at_capture:
            self._release_step()

    def end_training(self) -> None:
        """The loop ended: drop every reference to the unfinished step's batches."""
        self._release_step()

    # ---- listeners ----------------------------------------------------------------------------
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

    def _emit(self, event: Event, agreed: bool = False) -> None:
        if self._ranks is not None and not agreed and event.rank is None:
            event.rank = self._ranks.rank  # this rank's own event (an agreed one names its origin rank)
        if self._verifier is not None and self._kept_step is None:
            self._verifier(self, event)  # first, so listeners see the event with its verdicts
        self.events.append(event)
        self._notify("event", event)

    # ---- failure handling -------------------------------------------------------------------
    def _fail(self, exc: BaseException, safe: bool) -> None:
        """Record an internal error and step aside; removal waits for a point where it is safe
        (not while torch iterates the optimizer's hook dicts or the Trainer its callbacks)."""
        if self._broken:
            return
        self._broken = True
        if self._ranks is not None:
            self._ranks.owes_farewell = True
        self._emit(Event("watch-error", self.step,
                         f"nbguard's watch hit an internal error and detached itself; training goes on: "
                         f"{type(exc).__name__}: {exc}",
                         evidence={"exception": repr(exc), "traceback": traceback.format_exc(limit=6)}))
        try:
            warnings.warn(f"nbguard watch detached after an internal error: {exc!r}", RuntimeWarning, stacklevel=2)
        except Exception:  # warnings turned into errors (-W error, pytest): the event above is the record
            pass
        if safe:
            self._step_aside()

    # ---- hooks: micro-batches -----------------------------------------------------------------
    def _training_forward(self, module) -> bool:
        return not self._replaying and module.training and torch.is_grad_enabled()

    def _root_pre(self, module, args, kwargs):
        if self._broken and self.attached:
            self._step_aside()  # a safe point: module hooks were copied before being called
            return None
        if self._coverage_stale:
            self._cover_new_parameters()
        if self._forward_open and self._training_forward(module):
            self._release_step()  # the previous training forward never returned: it was interrupted
        self._forward_open = self._training_forward(module)
        self._capture_micro_batch(module, args, kwargs)
        return None

    @watch_hook(safe=True)
    def _capture_micro_batch(self, module, args, kwargs) -> None:
        if not self._training_forward(module):
            return
        hooks_see_backward = self._deepspeed is None or self._collector.accumulations > 0  # DeepSpeed: own buffers
        if self._micro_batches and hooks_see_backward \
                and self._collector.accumulations == self._accumulations_at_capture:
            self._release_step()  # no backward since the last forward: that step was abandoned
        self._accumulations_at_capture = self._collector.accumulations
        trainer_labels = self._labels_tap.take() if self._labels_tap is not None else None
        self._micro_batches.append(
            MicroBatch(len(self._micro_batches), args, dict(kwargs), capture_rng(), capture_autocast(),
                       trainer_labels=trainer_labels))
        for detector in self._board.detectors:
            detector.on_micro_batch(self._micro_batches[-1])

    @watch_hook(safe=False)
    def _root_post(self, module, args, kwargs, output):
        self._forward_open = False
        if not self._training_forward(module) or not self._micro_batches:
            return None
        self._collector.watch_backward(output)  # a backward through this forward: the capture is in use
        loss = model_loss(output)
        if loss is not None:
            self._losses.append(loss.detach())
        if self.localize:
            self._micro_batches[-1].record_output_grads(output)
        return None

    # ---- hooks: step boundaries -----------------------------------------------------------
    def _read(self) -> StepStats:
        if self._stats is None and self._ranks is not None and self._ranks.exchanges == 0 \
                and not self._ranks.all_ranks_watch():
            warnings.warn(f"nbguard: the watch runs on rank {self._ranks.rank} but not on every rank: it watches "
                          f"this rank alone (no agreement across ranks); call nbguard.watch on every rank",
                          RuntimeWarning, stacklevel=2)
            self._ranks = None
        if self._stats is None:
            binding = self._scaler_binding
            scale = binding.scale() if binding is not None else None
            found_inf = binding.found_inf() if binding is not None and binding.enabled else None
            # Trainer passes num_items_in_batch: each micro-batch loss is then a share of the step's loss
            shares = any("num_items_in_batch" in mb.kwargs for mb in self._micro_batches)
            self._stats = self._collector.read(self._losses, scale, False, sum_losses=shares,
                                               found_inf=found_inf,
                                               activations=self._probe.values if self._probe is not None else None,
                                               extra=self._board.collect(self),
                                               exchange=self._ranks.exchange if self._ranks is not None else None)
            if self._ranks is not None:
                self._verdict = self._ranks.settle(self._stats)
                if self._verdict.leaving:
                    self._peers_left(self._verdict)
        return self._stats

    def _scaler_guards(self) -> bool:
        """An enabled GradScaler already refuses non-finite updates: it decides, we count."""
        return self._scaler_binding is not None and self._scaler_binding.enabled

    def _pre_step(self, optimizer, args, kwargs):
        """Not a watch_hook itself: a watch that stepped aside across ranks still says farewell here."""
        if self._owes_farewell() and self._scaler_binding is None:
            self._farewell()
            return None
        self._check_step()
        self._settle_farewell()  # the check failed before this rank's part of the exchange: pay it now
        return None

    @watch_hook(safe=False)
    def _check_step(self) -> None:
        if not self._scaler_guards():
            self._check_update(self._read())

    @watch_hook(safe=False)
    def _post_step(self, optimizer, args, kwargs):
        self._optimizer_stepped = True
        if self._scaler_binding is None:
            self._end_step(skipped=self._step_dropped)
        return None

    def _before_scaler_update(self) -> None:
        """Not a watch_hook itself, for the same farewell as ``_pre_step``."""
        if self._owes_farewell():
            self._farewell()
            return
        self._read_before_update()
        self._settle_farewell()

    @watch_hook(safe=False)
    def _read_before_update(self) -> None:
        self._read()  # a skipped step never reached the optimizer hooks: read it here

    @watch_hook(safe=True)
    def _after_scaler_update(self) -> None:
        stats = self._read()
        if stats.found_inf is not None:
            scaler_skipped = stats.found_inf > 0 or not self._optimizer_stepped
        else:
            scaler_skipped = self._scaler_guards() and not self._optimizer_stepped
        self._end_step(skipped=self._step_dropped or scaler_skipped, scaler_skipped=scaler_skipped)

    # ---- the decisions --------------------------------------------------------------------
    def _check_update(self, stats: StepStats) -> None:
        """Before the optimizer moves anything: is this update finite? Apply the policy if not.

        Across ranks the agreed verdict decides, so every rank applies the same policy."""
        if not self._active():
            return
        verdict = self._verdict if self._ranks is not None else None
        finite = not verdict.bad_ranks if verdict is not None else stats.loss_finite and stats.grads_finite
        if finite:
            self._bad_streak = 0
            self._before_update(stats)
            return
        self._bad_streak += 1
        event: Event | None
        if self._bad_streak == 1:
            kind = "nonfinite-loss" if not stats.loss_finite else "nonfinite-grad"
            event = self._localised_event(kind, stats)
            self._emit(event, agreed=True)
        else:
            event = next((e for e in reversed(self.events) if e.kind in ("nonfinite-loss", "nonfinite-grad")), None)
            if event is not None:
                event.evidence["consecutive_bad_steps"] = self._bad_streak
        if self.policy in ("skip", "stop"):
            drop_update(self.optimizer, self.model)
            self._step_dropped = True
        if self.policy == "stop":
            self._stop(event)

    def _before_update(self, stats: StepStats) -> None:
        """The detectors see the finite update before the optimizer applies it; one may have it dropped
        under skip/stop (the weights stay the last good ones), and under stop training ends."""
        view = self._view(stats, skipped=False, scaler_skipped=False)
        dropper = update_dropper(self.policy, self._board.run("before_update", view, stats.extra, self._emit_from),
                                 across_ranks=self._ranks is not None)
        if dropper is None:
            return
        drop_update(self.optimizer, self.model)
        self._step_dropped = True
        dropper.evidence["update_dropped"] = True
        if self.policy == "stop":
            self._stop(dropper)

    def _view(self, stats: StepStats, skipped: bool, scaler_skipped: bool) -> StepView:
        return StepView(self.step, tuple(self.history.groups), tuple(stats.grad_norm), stats.loss, stats.loss_scale,
                        skipped, scaler_skipped if self._scaler_binding is not None else None, history=self.history)

    def _emit_from(self, detector: Detector, event: Event) -> None:
        self._emit(event, agreed=getattr(detector, "agreed", False))

    def _stop(self, event: Event | None, step_ended: bool = False) -> None:
        self._stop_requested = True
        if self.trainer is not None:
            if self._trainer_control is not None:
                self._trainer_control.should_training_stop = True
            return
        message = f"nbguard stopped training at step {event.step if event else self.step}: " + (
            event.message if event else "non-finite values")
        if not step_ended:
            self._end_step(skipped=True)
        raise NonFiniteError(message, event)

    def _end_step(self, skipped: bool, scaler_skipped: bool = False) -> None:
        stats = self._read()
        step = self.step
        self.history.append(step, list[float | None](stats.grad_norm), stats.loss, stats.total_grad_norm,
                            stats.loss_scale, skipped)
        activations = None
        if self.activation_history is not None and stats.activations is not None:
            activations = host_values(stats.activations)
            self.activation_history.append(step, activations)
        found = self._board.run("update", self._view(stats, skipped, scaler_skipped), stats.extra, self._emit_from)
        stop_event = training_stopper(self.policy, found, across_ranks=self._ranks is not None)
        self.step += 1
        payload: dict[str, Any] = {"step": step, "loss": stats.loss, "total_grad_norm": stats.total_grad_norm,
                   "loss_scale": stats.loss_scale, "skipped": skipped,
                   "grad_norm": dict(zip(self.history.groups, stats.grad_norm))}
        if activations is not None and self.activation_history is not None:
            payload["activation_absmax"] = dict(zip(self.activation_history.groups, activations))
        self._release_step()
        self._notify("step", payload)
        if stop_event is not None:
            self._stop(stop_event, step_ended=True)

    def _release_step(self) -> None:
        """Drop every reference to this step's batches and output gradients."""
        self._micro_batches = []
        self._losses = []
        self._stats = None
        self._optimizer_stepped = False
        self._step_dropped = False
        self._forward_open = False
        self._accumulations_at_capture = -1
        self._collector.reset()
        board: DetectorBoard | None = getattr(self, "_board", None)
        if board is not None:
            board.reset_step()
        if self._probe is not None:
            self._probe.reset()
        sync: ranks.RankSync | None = getattr(self, "_ranks", None)
        if sync is not None:
            sync.step_exchanged = False

    # ---- events and localisation ----------------------------------------------------------
    def _localised_event(self, kind: str, stats: StepStats, extra: dict | None = None,
                         budget: str = "nonfinite") -> Event:
        """``_make_event``, or across ranks the agreed event: the bad ranks localise, all get the same."""
        if self._ranks is None or self._verdict is None:
            return self._make_event(kind, stats, extra, budget)
        sync = self._ranks
        return ranks.agreed_event(sync, self._verdict, self.step,
                                  lambda: self._make_event(kind, stats, extra, budget, replay=not sync.sharded))

    def _make_event(self, kind: str, stats: StepStats, extra: dict | None = None, budget: str = "nonfinite",
                    replay: bool = True) -> Event:
        groups = self.history.groups
        evidence: dict[str, Any] = dict(extra or {})
        evidence.update({"loss": stats.loss, "total_grad_norm": stats.total_grad_norm,
                         "nonfinite_groups": [g for g, v in zip(groups, stats.grad_norm) if not math.isfinite(v)],
                         "micro_batches": len(self._micro_batches)})
        if stats.loss_scale is not None:
            evidence["loss_scale"] = stats.loss_scale
        cause, origins = None, []
        empty = [mb.index for mb in self._micro_batches if mb.has_no_supervised_tokens()]
        # 0/0 shows in the loss, or only in the gradients when the loss is computed outside the model.
        if empty and kind in ("nonfinite-loss", "nonfinite-grad"):
            cause = "no-supervised-tokens"
            evidence["micro_batches_without_labels"] = empty
        elif replay and self.localize and self._micro_batches and self._take_replay(budget):
            started = time.perf_counter()
            try:
                found = self._replay()
            except Exception as exc:  # e.g. out of memory: the event stands, unlocalised
                evidence["replay_error"] = f"{type(exc).__name__}: {exc}"
            else:
                cause, origins = found.cause, found.origins
                evidence.update(found.evidence)
            evidence["replay_seconds"] = time.perf_counter() - started
        return Event(kind, self.step, event_message(kind, cause, origins, evidence), cause, origins, evidence)

    def _take_replay(self, budget: str) -> bool:
        """Skip streaks (a fresh fp16 run has a few at start-up) do not use up the NaN events' replays."""
        used = self._skip_replays if budget == "skip" else self._replays
        if used >= self.settings.max_replays:
            return False
        if budget == "skip":
            self._skip_replays += 1
        else:
            self._replays += 1
        return True

    def _replay(self):
        if self._replayer is None:
            self._replayer = Replayer(self.model)
        with self.paused():
            return self._replayer.run(self._micro_batches)

    # ---- results ---------------------------------------------------------------------------
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
        return (f"<NanWatch {type(self.target).__name__} policy={self.policy} step={self.step} "
                f"events={len(self.events)} {'attached' if self.attached else 'detached'}>")
