"""The watch's step state machine: the hooks on forwards, backwards and optimizer steps, the one
read per step, the policy's decision before the update, and the step's end.

A step: training forwards are captured as micro-batches (``_root_pre``/``_root_post``); before the
optimizer moves (``_pre_step``, or the GradScaler's ``update`` under an enabled scaler) the sentinel's
one host read gives the step's numbers; a non-finite update is an event and, under skip/stop,
dropped; a finite one goes to the detectors' ``before_update``, whose events may drop it too; at the
step's end (``_end_step``) the history takes the step, every detector judges it, and under stop an
alarm ends training. Across ranks the read is exchanged, every rank decides on the agreed verdict,
and a watch that steps aside still joins one exchange so no peer waits for it.
"""
from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ...document.outward import warn
from ...errors import NonFiniteError
from ...findings import Event
from ...step.capture import MicroBatch, capture_rng, find_loss
from ...step.eager import eager_name
from ...step.precision import capture_autocast
from ..distributed import ranks
from ..distributed.rank_tokens import losses_are_rank_means, step_supervised_tokens
from ..integrations.loop import step_closure, then_after_first_call, with_closure
from ..policy.policies import drop_update, training_stopper, update_dropper
from ..reads.activations import host_values
from ..reads.deferred import ParkedStep, finite_flag, unavailable
from ..reads.sentinel import Gathered, StepStats
from .guard import watch_hook
from .pipeline import Detector, DetectorBoard, StepView
from .record import WatchRecord


class WatchSteps(WatchRecord):
    # ---- where a step starts and the loop ends (the Trainer callback calls these) --------------------
    def begin_step(self) -> None:
        """A step starts (the Trainer's ``on_step_begin``): what an interrupted step left is dropped,
        so the new step is judged on its own."""
        if self._micro_batches or self._losses or self._stats is not None:
            self._release_step()

    def end_training(self) -> None:
        """The loop ended: drop every reference to the unfinished step's batches."""
        self.flush()  # a step read late is judged before the components hear the loop ended
        self._dispatch("on_train_end")  # (the update norms' last read: no next step's read will bring it)
        self._release_step()

    def _dispatch(self, hook: str, *args: Any) -> None:
        """A lifecycle point to the components that implement it; one that fails is the watch's internal
        error (recorded; the watch steps aside at a safe point), never the user's."""
        self._board.dispatch(hook, *args, on_error=self._component_failed)

    def _component_failed(self, exc: BaseException) -> None:
        self._fail(exc, safe=False)

    # ---- hooks: micro-batches ------------------------------------------------------------------------
    def _training_forward(self, module) -> bool:
        return not self._replaying and module.training and torch.is_grad_enabled()

    def _root_pre(self, module, args, kwargs):
        if torch.compiler.is_compiling():  # see _traced
            return self._traced()
        if self._broken and self.attached:
            self._step_aside()  # a safe point: module hooks were copied before being called
            return None
        self._dispatch("on_forward_start")  # a sign of life (components keep it to a timestamp)
        if self._coverage_stale:
            self._cover_new_parameters()
        training = self._training_forward(module)
        if self._forward_open and training:
            self._release_step()  # the previous training forward never returned: it was interrupted
        self._forward_open = training
        if training:
            self._capture_micro_batch(args, kwargs)
        return None

    @watch_hook(safe=True)
    def _cover_new_parameters(self) -> None:
        """Hook the trainable parameters assigned since attach (before this forward runs)."""
        self._coverage_stale = False
        if self._ranks is not None:
            return  # every rank's read has the same shape, agreed at attach: a swap under DDP is not followed
        named = [(eager_name(n), p) for n, p in self.model.named_parameters() if p.requires_grad]
        if [id(p) for _, p in named] == [id(p) for p in self._collector.params]:
            return
        new_groups = self._collector.cover(named)
        if new_groups:
            self.history.add_groups(new_groups)
        self._modules_seen = weakref.WeakSet(self.model.modules())

    @watch_hook(safe=True)
    def _capture_micro_batch(self, args, kwargs) -> None:
        """A training forward starts (the caller checked): keep what its replay needs."""
        hooks_see_backward = self._deepspeed is None or self._collector.accumulations > 0  # DeepSpeed: own buffers
        if self._micro_batches and hooks_see_backward and not self._collector.backward_since_capture:
            self._release_step()  # no backward since the last forward: that step was abandoned
        self._collector.backward_since_capture = False
        trainer_labels = self._labels_tap.take() if self._labels_tap is not None else None
        micro_batch = MicroBatch(len(self._micro_batches), args, dict(kwargs), capture_rng(), capture_autocast(),
                                 trainer_labels=trainer_labels)
        self._micro_batches.append(micro_batch)
        if self._parked is not None:  # the components still hold the parked step's: they hear of this one after it
            self._queued_micro_batches.append(micro_batch)
        else:
            self._board.on_micro_batch(micro_batch)

    def _traced(self) -> None:
        """torch.compile is tracing the watched module: the watch was given the module inside a compiled one
        (``nbguard.watch(model)``, then ``torch.compile(model)(...)``). Python inside a trace would break the
        graph (an error under ``fullgraph=True``) or recompile on every count it reads: the watch stays out of
        it. It still reads the gradients at the step; what the forward would give (the loss, the micro-batches
        a replay needs) it says it lacks, once, at the step (``_say_traced``)."""
        self._forward_traced = True  # (a side effect dynamo replays each time the compiled code runs)
        return None

    def _say_traced(self) -> None:
        self._forward_traced = False
        if self._traced_said or self._micro_batches:
            return
        self._traced_said = True
        warn("nbguard: the watched module's forward runs inside torch.compile's trace (a compiled module calls it, "
             "or model.compile() compiled it in place), where the watch cannot run: it reads the gradients (a "
             "non-finite one is still caught at its step), but neither the loss nor the micro-batches a replay needs "
             "to name the module. Watch the module "
             "torch.compile returns, and call that: nbguard.watch(torch.compile(model), optimizer=...)",
             RuntimeWarning, stacklevel=2)

    @watch_hook(safe=False)
    def _root_post(self, module, args, kwargs, output):
        if torch.compiler.is_compiling():
            return None
        self._forward_open = False
        if not self._training_forward(module) or not self._micro_batches:
            return None
        found = find_loss(output)
        if found is not None and self._loss_tap is None:  # else the Trainer's, at training_step's end
            self._losses.append(found[1].detach())
        # A backward through this forward puts the capture in use: its outputs' hooks count it (the
        # replay's gradient keeper on the loss counts too: one hook there, not two)
        counter = self._collector.backward_counter()
        counted = self._micro_batches[-1].record_output_grads(output, found, counter) if self.localize else []
        self._collector.watch_backward(output, counted)
        return None

    @watch_hook(safe=True)
    def _take_trainer_loss(self, loss: torch.Tensor) -> None:
        """The loss a Trainer's training_step returned (TrainingLossTap), for the step now open."""
        if self._micro_batches:
            self._losses.append(loss.detach())

    @watch_hook(safe=True)
    def _take_backward_root(self, root: torch.Tensor) -> None:
        """The scalar a backward through the model started from (BackwardRoots): the step's loss where
        neither the model's output nor the Trainer gives one (a loss function after the model)."""
        if self._micro_batches:
            self._backward_roots.append(root)

    def _step_losses(self) -> tuple[list[torch.Tensor], bool]:
        """The step's losses, and whether they are shares to sum: the model's or the Trainer's, else
        the backward roots (each micro-batch's part of what was differentiated: under accumulation
        already divided, so their sum is the step's loss; under a GradScaler, scaled: unscaled here)."""
        if self._losses or not self._backward_roots:
            shares = self._loss_tap is not None or any("num_items_in_batch" in mb.kwargs for mb in self._micro_batches)
            return self._losses, shares
        scale = self._scaler_binding.scale() if self._scaler_binding is not None else None
        roots = self._backward_roots if scale is None else [root / scale for root in self._backward_roots]
        return roots, True

    # ---- the step's one read -------------------------------------------------------------------------
    def _grads_scaled(self) -> bool:
        binding = self._scaler_binding
        return binding is not None and self.optimizer is not None and binding.grads_scaled(self.optimizer)

    def weight_fingerprint(self) -> torch.Tensor:
        """Per-group sum of the trainable weights' norms, on the device (bit-identical only if they are)."""
        return self._collector.fingerprint()

    def _read(self) -> StepStats:
        if self._stats is None:
            self._check_peers_watch()
            binding = self._scaler_binding
            scale = binding.scale() if binding is not None else None
            found_inf = binding.found_inf() if binding is not None and binding.enabled else None
            # Each micro-batch loss is a share of the step's loss when the Trainer passes num_items_in_batch,
            # and when it is what training_step returned (their sum is the loss the Trainer logs)
            losses, shares = self._step_losses()
            self._stats = self._collector.read(losses, scale, False, sum_losses=shares,
                                               found_inf=found_inf,
                                               activations=self._probe.values if self._probe is not None else None,
                                               extra=self._board.collect(self),
                                               exchange=self._exchange())
            self._settle_ranks(self._stats)
        return self._stats

    def _check_peers_watch(self) -> None:
        """Before the first exchange: a watch on some ranks only watches its own rank alone (no peer to wait for)."""
        if self._ranks is not None and self._ranks.exchanges == 0 and not self._ranks.all_ranks_watch():
            warn(f"nbguard: the watch runs on rank {self._ranks.rank} but not on every rank: it watches "
                 f"this rank alone (no agreement across ranks); call nbguard.watch on every rank",
                 RuntimeWarning, stacklevel=3)
            self._ranks = None

    def _settle_ranks(self, stats: StepStats) -> None:
        """What every rank learned from the step's exchange; a peer that stepped aside: step aside too."""
        if self._ranks is not None:
            self._verdict = self._ranks.settle(stats)
            if self._verdict.leaving:
                self._peers_left(self._verdict)

    def _exchange(self) -> Callable[..., torch.Tensor] | None:
        """The step's collective across ranks, carrying this rank's supervised tokens (rank_tokens.py)."""
        if self._ranks is None:
            return None
        return functools.partial(self._ranks.exchange, tokens=step_supervised_tokens(self._micro_batches))

    # ---- hooks: step boundaries ----------------------------------------------------------------------
    def _scaler_guards(self) -> bool:
        """An enabled GradScaler already refuses non-finite updates: it decides, we count."""
        return self._scaler_binding is not None and self._scaler_binding.enabled

    def _pre_step(self, optimizer, args, kwargs):
        """Not a watch_hook itself: a watch that stepped aside across ranks still says farewell here.

        ``step(closure)`` (Lightning's automatic optimization, LBFGS): the step's forward and backward
        have not run yet; they run inside the closure, so the check follows the closure's first call."""
        closure = step_closure(args, kwargs)
        if closure is not None:
            return with_closure(args, kwargs, then_after_first_call(closure, self._closure_ran))
        self._before_optimizer_moves()
        return None

    def _closure_ran(self, loss: Any) -> None:
        """A step's closure returned: its loss is the step's where nothing else gave one; then the check."""
        if isinstance(loss, torch.Tensor) and loss.numel() == 1 and not self._backward_roots:
            self._take_backward_root(loss.detach())
        self._before_optimizer_moves()

    def _before_optimizer_moves(self) -> None:
        if self._owes_farewell() and self._scaler_binding is None:
            self._farewell()
            return
        self._check_step()
        self._settle_farewell()  # the check failed before this rank's part of the exchange: pay it now
        if self.active:  # after the policy's decision, just before the optimizer moves the weights
            self._hold_lr()
            self._dispatch("before_optimizer_step", self.step)

    @watch_hook(safe=False)
    def _hold_lr(self) -> None:
        """For a few steps after a divergence rewind, this update runs at most at the cut LR (in either read mode,
        under a GradScaler too); ``_post_step`` puts each LR back."""
        if self._rewinder is not None:
            self._rewinder.hold_lr(self._context, self.step)

    @watch_hook(safe=False)
    def _check_step(self) -> None:
        if self._forward_traced:
            self._say_traced()
        if self._scaler_guards():
            return
        if self._reads_late():
            self._finish_parked()  # the previous step's numbers, landed on the host meanwhile
            if self.active:  # (not where they said a peer stepped aside: no rank joins another exchange)
                self._gather_late()
            return
        self._check_update(self._read())

    @watch_hook(safe=False)
    def _post_step(self, optimizer, args, kwargs):
        self._device_skip.disarm()
        if self._rewinder is not None:
            self._rewinder.release_lr()
        self._optimizer_stepped = True
        self._dispatch("after_optimizer_step", self.step)
        if self._scaler_binding is None:
            if self._gathered is not None:
                self._park_step()
            else:
                self._end_step(skipped=self._step_dropped)
        return None

    # ---- statistics read a step late (WatchSettings(read="deferred"), reads/deferred.py) -------------
    def _reads_late(self) -> bool:
        """Whether this step's numbers go to the host a step late; where they cannot, said once."""
        if self.settings.read != "deferred":
            return False
        if self._late_for is not self.optimizer:  # decided per optimizer (a Trainer builds its own in train())
            self._late_for = self.optimizer
            why = unavailable(policy=self.policy, optimizer=self.optimizer,
                              per_parameter=self._collector.per_parameter, scaler=self._scaler_binding is not None,
                              activations=self._probe is not None)
            self._late = why is None
            if why is not None:
                warn(f"nbguard: read='deferred' is not possible here ({why}): the watch reads each step's numbers "
                     f"on the host before the update instead", RuntimeWarning, stacklevel=2)
        return self._late

    def _gather_late(self) -> None:
        """This step's numbers, stacked on the device (across ranks with the step's exchange, a collective, not
        read); a policy that drops bad updates arms the optimizer's device skip with their finiteness; then a copy
        to the host that nobody waits for."""
        self._check_peers_watch()
        losses, shares = self._step_losses()
        gathered = self._collector.gather(losses, None, False, sum_losses=shares, extra=self._board.collect(self),
                                          exchange=self._exchange())
        if gathered.vector is None:
            return
        self._gathered = gathered
        exploded = None
        if self.policy in ("skip", "stop", "rewind") and self.active:
            if self._ranks is not None:  # every rank's flags: every rank skips alike (only agreed verdicts drop
                # an update across ranks, and a divergence is each rank's own: none is judged on the device)
                finite = self._ranks.finite_on_every_rank(gathered.vector[-gathered.n_exchanged:])
            else:
                exploded = self._explodes_on_device(gathered)
                finite = finite_flag(gathered.vector, gathered.n_checked)
            self._device_skip.arm(self.optimizer, finite, exploded)
        # (the device's divergence verdict travels with the numbers: the late judgement knows what it dropped)
        self._mirror.start(gathered.vector, exploded)

    def _explodes_on_device(self, gathered: Gathered) -> torch.Tensor | None:
        """Whether a component will drop this finite update (a divergence), judged now on the device."""
        vector = gathered.vector
        if vector is None or not gathered.n_norms:
            return None
        total = torch.linalg.vector_norm(vector[:gathered.n_norms])
        return self._board.drops_on_device(total, vector[gathered.n_norms] if gathered.has_loss else None)

    def _park_step(self) -> None:
        """The optimizer moved: this step waits for its numbers; the watch is free for the next one."""
        gathered, self._gathered = self._gathered, None
        self._parked = ParkedStep(gathered, self._micro_batches, self._losses, self._backward_roots,
                                  self._optimizer_stepped,
                                  skipped_on_device=self.policy in ("skip", "stop", "rewind") and self.active,
                                  judged_on_device=self._mirror.carries_verdict, replaced=self._pending_replaced)
        self._pending_replaced = False
        self._micro_batches, self._losses, self._backward_roots = [], [], []
        self._stats = self._step_view = None
        self._optimizer_stepped = self._step_dropped = self._forward_open = False
        self._collector.reset()
        if self._ranks is not None:
            self._ranks.step_exchanged = False

    def flush(self) -> None:
        """Judge the step whose numbers are still on their way (``read="deferred"``): the loop ended, or you
        read the watch's events now. Nothing to do otherwise."""
        if self._parked is not None:
            self._finish_parked()

    @watch_hook(safe=True)
    def _finish_parked(self) -> None:
        """The parked step judged as the host mode judges a step, a step late: its events, localisation (on
        its own micro-batches), detectors, history; the policy acts on the update now pending."""
        parked, self._parked = self._parked, None
        if parked is None:
            return
        current = (self._micro_batches, self._losses, self._backward_roots, self._stats, self._step_view,
                   self._optimizer_stepped, self._step_dropped)
        values = self._mirror.values()
        exploded = parked.judged_on_device and values.pop() > 0  # the device dropped this finite update
        stats = self._collector.decode(parked.gathered, values, rereads=False)
        self._settle_ranks(stats)
        if not self.active:  # a peer stepped aside at this step: every rank steps aside at it, unjudged
            return
        self._micro_batches, self._losses, self._backward_roots = parked.micro_batches, parked.losses, \
            parked.backward_roots
        self._stats, self._step_view, self._optimizer_stepped = stats, None, parked.optimizer_stepped
        # (across ranks, any rank's bad step: every rank's device skip dropped it)
        verdict = self._verdict if self._ranks is not None else None
        bad = bool(verdict.bad_ranks) if verdict is not None else not (stats.loss_finite and stats.grads_finite)
        self._step_dropped = bad and parked.skipped_on_device
        # where the bad update was applied (warn), a replay would run on the weights it changed
        self._replay_trusted = not bad or parked.skipped_on_device
        self._judging_late, self._exploded_on_device = True, exploded
        try:
            if not parked.replaced:
                self._check_update(stats)
            # (where the host's fp64 judgement fell a rounding short of the device's bound, no event drops it)
            self._step_dropped = self._step_dropped or exploded or parked.replaced
            self._end_step(skipped=self._step_dropped)
        finally:
            self._judging_late, self._replay_trusted, self._exploded_on_device = False, True, False
            (self._micro_batches, self._losses, self._backward_roots, self._stats, self._step_view,
             self._optimizer_stepped, self._step_dropped) = current
            queued, self._queued_micro_batches = self._queued_micro_batches, []
            for micro_batch in queued:
                self._board.on_micro_batch(micro_batch)

    def _drop_pending_update(self, event: Event | None) -> None:
        """Judged late, the judged step's update is history (dropped on the device if it was not finite):
        the update now pending, computed from what it left, is the one the policy drops."""
        drop_update(self.optimizer, self.model)
        self._device_skip.disarm()
        if event is not None:
            event.evidence["next_update_dropped"] = True

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

    @watch_hook(safe=False)
    def _zero_grad(self) -> None:
        """Gradients cleared after a backward of this step: the step was abandoned (interrupted)."""
        if self._micro_batches and self._collector.backward_since_capture:
            self._release_step()

    # ---- the policy: before the update ---------------------------------------------------------------
    def _check_update(self, stats: StepStats) -> None:
        """Before the optimizer moves anything: is this update finite? Apply the policy if not.

        Across ranks the agreed verdict decides, so every rank applies the same policy."""
        if not self.active:
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
            if self._judging_late and kind == "nonfinite-grad":
                event.evidence["overflow_unchecked"] = (
                    "read a step late (read='deferred'): the step's gradients are gone, so finite gradients whose "
                    "fp32 norm overflowed (an explosion) cannot be told from non-finite ones")
            self._emit(event, agreed=True)
        else:
            event = next((e for e in reversed(self.events) if e.kind in ("nonfinite-loss", "nonfinite-grad")), None)
            if event is not None:
                event.evidence["consecutive_bad_steps"] = self._bad_streak
        if self.policy in ("skip", "stop", "rewind") and not self._judging_late:
            drop_update(self.optimizer, self.model)
            self._step_dropped = True
        if self.policy == "stop":
            if self._judging_late:  # a Trainer ends after the step under way: not with its update
                self._drop_pending_update(event)
            self._stop(event)
        if self.policy == "rewind" and self._rewinder is not None:
            self._rewind(event)
            if self._judging_late:  # the pending update was computed on the weights the rewind replaced
                self._drop_pending_update(event)

    def _before_update(self, stats: StepStats) -> None:
        """The detectors see the finite update before the optimizer applies it; one may have it dropped
        under skip/stop (the weights stay the last good ones), and under stop training ends."""
        view = self._view(stats, skipped=False, scaler_skipped=False)
        dropper = update_dropper(self.policy, self._board.run("before_update", view, stats.extra, self._emit_from),
                                 across_ranks=self._ranks is not None)
        if dropper is None:
            return
        if self._judging_late and not self._exploded_on_device:  # applied before the numbers reached the host
            dropper.evidence["update_dropped"] = False
            self._drop_pending_update(dropper)
        else:
            if not self._judging_late:
                drop_update(self.optimizer, self.model)
            elif self.policy in ("stop", "rewind"):  # dropped on the device; the update now pending is void too
                self._drop_pending_update(dropper)
            self._step_dropped = True
            dropper.evidence["update_dropped"] = True
        if self.policy == "stop":
            self._stop(dropper)
        if self.policy == "rewind" and self._rewinder is not None:
            self._rewind(dropper)

    def _rewind(self, event: Event | None) -> None:
        """Policy rewind answers ``event``. Judged a step late, the step under way ran its forward and backward on
        the weights a rewind has just replaced (its update is dropped): its numbers are of weights no longer
        there, so it is recorded as skipped and not judged (its NaN would be a second event of the same blow-up)."""
        assert self._rewinder is not None
        rewinds = self._rewinder.rewinds
        self._rewinder.respond(self._context, event, self.step)
        if self._judging_late and self._rewinder.rewinds > rewinds:
            self._pending_replaced = True

    def _view(self, stats: StepStats, skipped: bool, scaler_skipped: bool) -> StepView:
        """The step as the detectors see it; the view ``before_update`` got again at the step's end
        when nothing it shows changed (the usual step: a view is read-only)."""
        scaler_skipped_seen = scaler_skipped if self._scaler_binding is not None else None
        last = self._step_view
        if last is not None and last.skipped == skipped and last.scaler_skipped == scaler_skipped_seen:
            return last
        view = StepView(self.step, tuple(self.history.groups), tuple(stats.grad_norm), stats.loss, stats.loss_scale,
                        skipped, scaler_skipped_seen, history=self.history, norm_overflow=stats.norm_overflow)
        self._step_view = view
        return view

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

    # ---- the step's end ------------------------------------------------------------------------------
    def _end_step(self, skipped: bool, scaler_skipped: bool = False) -> None:
        stats = self._read()
        step = self.step
        total_grad_norm = stats.total_grad_norm
        self.history.append(step, stats.grad_norm, stats.loss, total_grad_norm, stats.loss_scale, skipped)
        activations = None
        if self.activation_history is not None and stats.activations is not None:
            activations = host_values(stats.activations)
            self.activation_history.append(step, activations)
        found = self._board.run("update", self._view(stats, skipped, scaler_skipped), stats.extra, self._emit_from)
        if self._ranks is not None and self._verdict is not None:  # the same counts, so the same event, on every rank
            uneven = self._rank_tokens.judge(step, self._verdict.tokens,
                                             losses_are_rank_means(self.trainer, self._micro_batches),
                                             trainer=self.trainer is not None)
            if uneven is not None:
                self._emit(uneven, agreed=True)
        stop_event = training_stopper(self.policy, found, across_ranks=self._ranks is not None)
        self.step += 1
        if self._judging_late:  # the next step is under way: only the judged step's per-step state goes
            self._board.reset_step()
        else:
            self._release_step()
        if self._listeners:  # (the payload's dicts are built only for someone to read them)
            payload: dict[str, Any] = {"step": step, "loss": stats.loss, "total_grad_norm": total_grad_norm,
                                       "loss_scale": stats.loss_scale, "skipped": skipped,
                                       "grad_norm": dict(zip(self.history.groups, stats.grad_norm))}
            if activations is not None and self.activation_history is not None:
                payload["activation_absmax"] = dict(zip(self.activation_history.groups, activations))
            self._dispatch("step_payload", payload)
            self._notify("step", payload)
        if self._rewinder is not None:  # policy rewind: a snapshot, or a rewind judged at the step's end
            self._rewinder.step_ended(self._context, step, skipped, found)
        if stop_event is not None:
            self._stop(stop_event, step_ended=True)

    def _release_step(self) -> None:
        """Drop every reference to this step's batches and output gradients (a parked step is judged first)."""
        if getattr(self, "_parked", None) is not None:
            self._finish_parked()
        self._queued_micro_batches = []
        self._gathered = None
        self._micro_batches = []
        self._losses = []
        self._backward_roots = []
        self._stats = None
        self._step_view = None
        self._optimizer_stepped = False
        self._step_dropped = False
        self._pending_replaced = False
        self._forward_open = False
        self._collector.reset()
        board: DetectorBoard | None = getattr(self, "_board", None)
        if board is not None:
            board.reset_step()
        if self._probe is not None:
            self._probe.reset()
        sync: ranks.RankSync | None = getattr(self, "_ranks", None)
        if sync is not None:
            sync.step_exchanged = False

    # ---- ranks: a watch that steps aside still joins one exchange so no peer waits for it ------------
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

    def _remove_step_bindings(self) -> None:
        if self._opt_binding is not None:
            self._opt_binding.remove()
            self._opt_binding = None
        if self._scaler_binding is not None:
            self._scaler_binding.remove()
            self._scaler_binding = None
