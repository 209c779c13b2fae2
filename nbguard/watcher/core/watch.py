"""``NanWatch``: the per-step NaN/Inf watch, its events, history and policies.

The watch is built in layers, one job each: :mod:`.record` (its state, events, listeners and
failures), :mod:`.steps` (the step state machine and the policy decision over the detectors),
:mod:`.lifecycle` (attach/detach), and here construction and the interface integrations use.
Event text and localisation are in :mod:`.events`, the detectors in :mod:`.pipeline`.
"""
from __future__ import annotations

import sys
import uuid
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ...findings import Displayable, Event
from ...step.capture import MicroBatch
from ...step.eager import eager_name, user_module
from ..detectors.builtin import builtin_detectors
from ..detectors.scaler_skips import ScalerSkips
from ..detectors.thresholds import WatchSettings
from ..distributed import ranks
from ..distributed.fsdp_grads import read_before_reduce
from ..distributed.rank_tokens import RankTokenBalance
from ..integrations.loop import unwrap_optimizer
from ..localise.events import Localiser, fold_skip_streaks, skip_streaks
from ..localise.rows import RowTracker
from ..policy.policies import check_policy
from ..policy.rewind import Rewinder, RewindSettings
from ..reads.activations import FP16_LIMIT, ActivationProbe
from ..reads.deferred import DeviceSkip, HostMirror
from ..reads.history import ActivationHistory, GradHistory
from ..reads.sentinel import GradNormCollector
from .config import WatchConfig, config_from_keywords
from .context import WatchContext
from .guard import watch_hook
from .lifecycle import WatchLifecycle, attached_watch, attached_watches
from .pipeline import Detector, DetectorBoard
from .registry import make_components

__all__ = ["NanWatch", "attached_watch", "attached_watches", "fold_skip_streaks", "skip_streaks"]


def _is_trainer(obj) -> bool:
    # A Trainer exists only once transformers.trainer is imported: asking sys.modules keeps a plain
    # torch model's watch from importing transformers (and, through it, peft and accelerate).
    module = sys.modules.get("transformers.trainer")
    trainer = getattr(module, "Trainer", None)
    return trainer is not None and isinstance(obj, trainer)


class NanWatch(WatchLifecycle, Displayable):
    """Watches a model (with its optimizer) or a Trainer for non-finite losses and gradients.

    The normal path reads one small tensor per optimizer step; on the first bad step the step is
    replayed eagerly with hooks on every module to name where the NaN/Inf was born.
    ``activations=True`` adds forward hooks on the module groups that record each group's output
    abs-max per step (into the same read) for a heatmap against the fp16 limit.
    """

    def __init__(self, target, *, optimizer=None, scaler=None, policy: str = "warn", localize: bool = True,
                 settings: WatchSettings | None = None, activations: bool = False,
                 verifier: Callable[[NanWatch, Event], None] | None = None,
                 detectors: list[Detector] | tuple[Detector, ...] = (),
                 rewind: RewindSettings | None = None, scheduler: Any = None, config: WatchConfig | None = None,
                 **deprecated: Any):
        if not isinstance(detectors, (list, tuple)):
            raise TypeError(f"detectors must be a list of Detector instances, got {type(detectors).__name__}")
        if not isinstance(activations, bool):
            raise TypeError(f"activations must be True or False, got {type(activations).__name__}")
        if verifier is not None and not callable(verifier):
            raise TypeError(f"verifier must be callable as verifier(watch, event), got {type(verifier).__name__}")
        # verifier(watch, event) for the first localised non-finite event: nbguard.watch passes
        # nbguard.verifier.auto_verify (which runs the fixes on a shadow of the step) unless verify=False
        self._verifier = verifier
        # each registered component's settings (registry.py); a component's old keywords fold in, deprecated
        self.config = config_from_keywords(config, deprecated)
        self._context = WatchContext(self)  # all a component may use of the watch (context.py)
        self.verification = None  # the Verification it left
        self._kept_step = None  # (event, CapturedStep) that nbguard.verify(event) reuses
        self.policy = check_policy(policy)
        if rewind is not None and not isinstance(rewind, RewindSettings):
            raise TypeError(f"rewind must be a nbguard.watcher.RewindSettings, got {type(rewind).__name__}")
        if scheduler is not None and not callable(getattr(scheduler, "step", None)):
            raise TypeError(f"scheduler must be the LR scheduler your loop steps (torch.optim.lr_scheduler), "
                            f"got {type(scheduler).__name__}")
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
            self.model = user_module(target)  # DDP, Fabric: hook and replay the user's module
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
        named = [(eager_name(n), p) for n, p in self.model.named_parameters() if p.requires_grad]
        self._collector = GradNormCollector(named, lambda exc: self._fail(exc, safe=False), self._grads_scaled)
        self.history = GradHistory(self._collector.groups, self.settings.history_capacity)
        # multi-rank runs: one small collective per step, folded into the read
        self._ranks = ranks.RankSync.detect(self._collector.params, len(self._collector.groups))
        self._collector.per_parameter = self._ranks is not None or ranks.needs_parameter_hooks(target, self._collector.params)
        if self._ranks is not None and self._ranks.sharded:  # FSDP2: each rank's own gradient, before the reduction
            self._ranks.pre_reduce = read_before_reduce(self.model, named, self._collector)
        self._bucket_reader = None  # DDP: its communication hook reads this rank's buckets (ddp_buckets)
        self._verdict = None
        self._streamer = None  # a forked rank's stream to the kernel (stream.RankStreamer)
        self._keep_farewell = False
        self._deepspeed = None  # DeepSpeed's skips, from its engine or its log lines (lifecycle._read_deepspeed)
        self._probe = None
        self.activation_history = None  # None unless activations=True
        if activations:
            self._probe = ActivationProbe(self.model, self._collector.groups,
                                          lambda m: self.active and self._training_forward(m),
                                          lambda exc: self._fail(exc, safe=False))
            self.activation_history = ActivationHistory(self._probe.groups, self.settings.history_capacity,
                                                        FP16_LIMIT)
        self.events = []
        self.step = 0
        self.attached = False
        self._listeners = []
        self._localiser = Localiser(self.model, self.settings.max_replays, self.paused)
        self._handles = []
        self._modules_seen = weakref.WeakSet()
        self._forward_open = False  # a training forward started and has not returned
        self._coverage_stale = False
        self._opt_binding = None
        self._scaler_binding = None
        self._callback = None  # WatchCallback, Trainer only
        self._labels_tap = None  # LabelsTap, Trainer only: labels the Trainer keeps from the model
        self._loss_tap = None  # TrainingLossTap: a Trainer whose loss is not its model's own
        self._trainer_control = None
        self._stop_requested = False
        self._broken = False
        self._replaying = False
        self._bad_streak = 0
        # the components, in the order they judge a step: the GradScaler's skips, the built-in detectors, the
        # registered components, the user's detectors, then those registered last (the run checks); an added
        # detector goes before the last ones
        scaler_skips = ScalerSkips(self.settings, lambda kind, extra, budget: self._localised_event(
            kind, self._read(), extra, budget))
        components, last = make_components(self.config.sections(), policy=self.policy,
                                           trainer=self.trainer,
                                           thresholds=self.settings, reads=self._collector, history=self.history)
        self._board = DetectorBoard([scaler_skips, *builtin_detectors(self.settings), *components, *detectors],
                                    last=last)
        self._micro_batches = []
        self._losses = []
        self._backward_roots = []
        # read="deferred" (reads/deferred.py): the step whose numbers are on their way, the micro-batches the
        # components hear of after it, this step's gathered numbers, and the device skip and host buffer
        self._parked = None
        self._forward_traced = False  # torch.compile traced the watched module's forward (steps._traced)
        self._traced_said = False
        self._queued_micro_batches = []
        self._gathered = None
        self._late_for: Any = ()  # the optimizer the mode was decided for (none yet)
        self._late = False
        self._judging_late = False
        self._exploded_on_device = False
        self._pending_replaced = False  # (read late) a rewind replaced the weights the step under way ran on
        self._replay_trusted = True
        self._device_skip = DeviceSkip()
        self._mirror = HostMirror()
        self._backward_binding = None  # BackwardRoots while attached
        self._stats = None
        # policy rewind (rewind.py): snapshots every few steps, restored on trouble; it says at once
        # where they do not fit (and the watch skips instead)
        self._rows = RowTracker()
        self._rank_tokens = RankTokenBalance()  # across ranks: do their losses weigh tokens alike?
        self._rows_named = 0
        self._rewinder = Rewinder(rewind or RewindSettings(), scheduler) if self.policy == "rewind" else None
        self._release_step()
        if self._rewinder is not None:
            why = self._rewinder.check_budget(self._context)
            if why is not None:
                self._rewinder.turn_off(self._context, why)

    @property
    def stop_requested(self) -> bool:
        """The stop policy asked the training loop to end (a Trainer ends after this step)."""
        return self._stop_requested

    def record_eval_loss(self, eval_loss: float, global_step: int | None = None) -> None:
        """An evaluation's loss (a plain loop's evaluation): as if the trainer had logged it."""
        self.record_log({"eval_loss": float(eval_loss)})

    @watch_hook(safe=False)
    def record_log(self, logs: dict[str, Any]) -> None:
        """The trainer logged metrics after a step (``Trainer.log``): every detector's ``on_log``."""
        step = max(self.step - 1, 0)  # the optimizer step the metrics are about
        # the run checks (last) read TRL's rewards, margins, ratios; a logged metric is this rank's own
        self._board.on_log(step, logs, lambda _, event: self._emit(event))

    def track_rows(self, loader: Any, tokenizer: Any = None) -> bool:
        """Record the dataset indices ``loader`` (a DataLoader over a map-style dataset) yields, so a bad
        step's event names its rows by dataset index (a Trainer's train dataloader is followed by
        itself). False where the loader has no sampler to follow; the rows are then named by
        micro-batch and position. ``tokenizer``: a named row's event then carries a short decoded
        excerpt of it (redacted), as a Trainer's processing class gives."""
        if tokenizer is not None and not callable(getattr(tokenizer, "decode", None)):
            raise TypeError(f"tokenizer must have a decode method (a transformers tokenizer), got "
                            f"{type(tokenizer).__name__}")
        if tokenizer is not None:
            self._rows.tokenizer = tokenizer
        if not self._rows.follow(loader):
            return False
        if self._rows not in self._board.detectors:
            self._board.add(self._rows)
        return True

    @property
    def rewinds(self) -> list[dict[str, Any]]:
        """Policy rewind: one entry per rewind (the step, the step restored to, the batches skipped, the LR factor)."""
        return list(self.history.rewinds)

    @property
    def detectors(self) -> list[Detector]:
        return list(self._board.detectors)

    def add_detector(self, detector: Detector) -> Detector:
        """Add a detector (see :class:`nbguard.watcher.Detector`); it judges from the next step on."""
        self._board.add(detector)
        return detector

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
