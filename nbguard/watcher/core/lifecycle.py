"""Attaching a watch and detaching it: every hook registered all or nothing, and removed again.

One watch per target: a second watch on the same model or Trainer replaces the first. The map of
attached watches holds targets and watches weakly (the watch holds its target: a strong value would
keep the key, and with it the model, alive for ever); :func:`attached_watches` is how another
package (the verifier's shadow step) finds them.
"""
from __future__ import annotations

import sys
import weakref
from typing import Any, TypeVar

import torch

from ...errors import NonFiniteError
from ..distributed import ranks
from ..distributed.ddp_buckets import bucket_reader, find_ddp
from ..integrations.loop import BackwardRoots, OptimizerBinding, ScalerBinding, unwrap_optimizer
from .guard import guarded_call, watch_hook
from .steps import WatchSteps

W = TypeVar("W", bound="WatchLifecycle")  # attach/detach return the watch itself (a NanWatch)

# target -> (a weak reference to) the watch attached to it
_ATTACHED: weakref.WeakKeyDictionary[Any, weakref.ref[WatchLifecycle]] = weakref.WeakKeyDictionary()


def attached_watch(target: Any) -> WatchLifecycle | None:
    """The watch currently registered on ``target``, if it is still alive."""
    ref = _ATTACHED.get(target)
    return ref() if ref is not None else None


def attached_watches() -> list[WatchLifecycle]:
    """Every watch registered on a target and still alive (a snapshot: attaching or detaching
    while the caller iterates does not change it)."""
    alive = [ref() for ref in list(_ATTACHED.values())]  # the map holds weak references to the watches
    return [w for w in alive if w is not None]


class WatchLifecycle(WatchSteps):
    # ---- attach / detach -----------------------------------------------------------------------------
    def attach(self: W) -> W:
        """Register every hook; all or nothing: on any error, everything registered so far is removed."""
        if self.attached:
            return self
        try:
            return self._attach()
        except BaseException:
            self._keep_farewell = False
            self.detach()
            raise

    def _attach(self: W) -> W:
        previous = attached_watch(self.target)
        if previous is not None and previous is not self and previous.attached:
            previous.detach()  # never stack two watches' hooks on one model
        self._broken = False
        self._handles = [
            self.model.register_forward_pre_hook(self._root_pre, with_kwargs=True),
            self.model.register_forward_hook(self._root_post, with_kwargs=True),
        ]
        self._read_ddp_buckets()
        self._collector.attach()
        self._handles += self._watch_registrations()
        self._backward_binding = self._bind_backward_roots()
        if self._probe is not None:
            self._probe.attach()
        if self.optimizer is not None:
            self._opt_binding = self._bind_optimizer(self.optimizer)
        if self.scaler is not None:
            self._scaler_binding = self._bind_scaler(self.scaler)
        if self.trainer is not None:
            from ..integrations.trainer import LabelsTap, TrainingLossTap, WatchCallback, trainer_computes_its_loss

            self._callback = WatchCallback(self)
            self.trainer.add_callback(self._callback)
            if trainer_computes_its_loss(self.trainer):  # read before LabelsTap sets compute_loss on it
                self._loss_tap = TrainingLossTap(self.trainer, self._take_trainer_loss, self._context.fail)
            self._labels_tap = LabelsTap(self.trainer, self._context.fail)
            if self._rows not in self._board.detectors:  # its attach follows the dataset indices the Trainer draws
                self._board.add(self._rows)
            self.attached = True
            self.bind_trainer_step()
        self.attached = True
        _ATTACHED[self.target] = weakref.ref(self)  # the value is weak: the watch holds its target
        from ...session import record_watch

        record_watch(self)
        self._board.attach(self._context)  # the components' own attach (threads, patches)
        if "deepspeed" in sys.modules and self._deepspeed is None:
            self._deepspeed = self._read_deepspeed()
        if self._ranks is not None:
            self._ranks.announce()  # peers check at the first step that every rank watches
        if self._ranks is not None and self._streamer is None:
            from ..distributed.stream import connect  # a forked rank of a %%nanwatch cell: the kernel shows it live

            self._streamer = connect(self, self._ranks.rank, self._ranks.world_size)
        return self

    def _read_deepspeed(self) -> Any:
        """Its engine skips steps itself: read them from the engine where the watch was given one,
        else from DeepSpeed's log lines (a Trainer builds its engine inside ``train()``)."""
        from ..distributed.deepspeed_engine import DeepSpeedEngineReader, find_engine
        from ..distributed.deepspeed_skips import DeepSpeedSkips

        engine = find_engine(self.target)
        if engine is not None:
            return DeepSpeedEngineReader(self._context, engine).attach()
        return DeepSpeedSkips(self).attach()

    def _bind_backward_roots(self) -> BackwardRoots:
        """The loss at backward's root (a global function's patch): it holds the watch weakly, so a
        watch dropped while attached is still collected (``__del__`` then takes the patch off)."""
        watch = weakref.ref(self)

        def backwards() -> int:
            live = watch()
            return live._collector.accumulations if live is not None else 0

        def took(root: torch.Tensor) -> None:
            live = watch()
            if live is not None:
                live._take_backward_root(root)

        def failed(exc: BaseException) -> None:
            live = watch()
            if live is not None:
                live._context.fail(exc)

        return BackwardRoots(backwards, took, failed)

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

    def detach(self: W) -> W:
        self._device_skip.disarm()
        if self._rewinder is not None:
            self._rewinder.release_lr()  # (a step that never reached its end keeps no capped LR)
        try:
            self.flush()  # read="deferred": the last step is judged before the components go
        except NonFiniteError:  # the stop policy's ending, here of a loop that already ended: the event is kept
            pass
        if self._board.context is not None:  # the components' threads end here: nothing of the watch runs on
            guarded_call(lambda exc: self._fail(exc, safe=False), self._board.detach)
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._backward_binding is not None:
            self._backward_binding.remove()
            self._backward_binding = None
        self._collector.detach()
        if self._bucket_reader is not None:  # DDP keeps its hook: from now on it only reduces
            self._bucket_reader.point_at(None)
            self._bucket_reader = None
            self._collector.bucketed, self._collector.per_parameter = False, True  # the next attach decides again
        if self._probe is not None:
            self._probe.detach()
        if not (self._keep_farewell and self._owes_farewell()):
            self._remove_step_bindings()
            if self._ranks is not None:
                self._ranks.owes_farewell = False  # detached by the user: nothing is left to say
        if self._callback is not None and self.trainer is not None:
            self.trainer.remove_callback(self._callback)
            self._callback = None
        for tap in (self._labels_tap, self._loss_tap):
            if tap is not None:
                tap.remove()
        self._labels_tap = self._loss_tap = None
        if self._deepspeed is not None:
            self._deepspeed.detach()
            self._deepspeed = None
        self._release_step()
        was_attached, self.attached = self.attached, False
        if attached_watch(self.target) is self:
            del _ATTACHED[self.target]
        if was_attached:
            from ...session import release_watch

            release_watch(self)  # the session keeps this watch's document, not the watch
        return self

    def __del__(self) -> None:
        # Collected while attached (the user deleted the model with the watch on): the session
        # keeps the story for the report. Never raise from a finalizer.
        try:
            binding = getattr(self, "_backward_binding", None)
            if binding is not None:
                binding.remove()
            if getattr(self, "attached", False):
                from ...session import release_watch

                release_watch(self)
        except Exception:
            pass

    def __enter__(self: W) -> W:
        return self.attach()

    def __exit__(self, *exc: object) -> None:
        self.detach()  # exceptions propagate

    # ---- a Trainer creates its optimizer and GradScaler inside train(): bind them then ---------------
    def begin_training(self, control: Any = None) -> None:
        """A (new) ``Trainer.train()`` starts: forget an earlier stop and whatever an interrupted run
        left (its step's batches, losses, read and bad streak), bind the optimizer and scaler."""
        self._stop_requested = False
        self._bad_streak = 0
        self._dispatch("on_train_begin")
        self.begin_step()
        self.bind_trainer_step(control)
        self._switch_to_ddp_buckets()

    @watch_hook(safe=False)
    def _switch_to_ddp_buckets(self) -> None:
        """``train()`` has wrapped the model in DDP by now, before its first step: read its buckets."""
        if self._ranks is not None and not self._collector.bucketed and find_ddp(self.target) is not None:
            self._collector.detach()
            self._read_ddp_buckets()
            self._collector.attach()

    def _read_ddp_buckets(self) -> None:
        """Across DDP ranks, this rank's own gradient norms from DDP's communication hook (one fused norm
        per bucket, see :mod:`.ddp_buckets`) instead of a hook per parameter, where the DDP module is
        known and takes the hook. Called while the collector is detached."""
        if self._ranks is None or self._ranks.sharded or self._collector.bucketed \
                or ranks.needs_parameter_hooks(self.target, self._collector.params):
            return
        ddp = find_ddp(self.target)
        reader = bucket_reader(ddp) if ddp is not None else None
        if reader is None:
            return
        reader.point_at(self._collector)
        self._bucket_reader = reader
        self._collector.per_parameter, self._collector.bucketed = False, True

    @watch_hook(safe=False)
    def bind_trainer_step(self, control: Any = None) -> None:
        """Keep the Trainer's ``control`` (to end training on ``stop``) and bind the optimizer and
        GradScaler, which the Trainer and accelerate create inside ``train()``."""
        if control is not None:
            self._trainer_control = control
        if self.trainer is None:
            return
        from ..integrations.trainer import trainer_scaler

        opt = self.trainer.optimizer
        if opt is not None:
            inner = unwrap_optimizer(opt)
            if self._opt_binding is None or self._opt_binding.optimizer is not inner:
                if self._opt_binding is not None:
                    self._opt_binding.remove()
                self.optimizer = inner
                self._opt_binding = self._bind_optimizer(inner)
        scaler = trainer_scaler(self.trainer)
        if scaler is not None and (self._scaler_binding is None or self._scaler_binding.scaler is not scaler):
            if self._scaler_binding is not None:
                self._scaler_binding.remove()
            self.scaler = scaler
            self._scaler_binding = self._bind_scaler(scaler)

    def _bind_scaler(self, scaler: Any) -> ScalerBinding:
        return ScalerBinding(scaler, self._before_scaler_update, self._after_scaler_update, self._context.fail)

    def _bind_optimizer(self, optimizer: torch.optim.Optimizer) -> OptimizerBinding:
        return OptimizerBinding(optimizer, self._pre_step, self._post_step, self._zero_grad, self._context.fail)
