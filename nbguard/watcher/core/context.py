"""What a watch component may use of the watch: the one door from a component into the core.

A component gets a :class:`WatchContext` in ``attach(context)`` and keeps it; nothing outside the core
(:mod:`.record`, :mod:`.steps`, :mod:`.lifecycle`, :mod:`.watch` and this module) touches the watch's
private state (``tests/test_watch_private_state.py`` walks the source for ``watch._*``). The context
holds the watch weakly: a thread a component starts (the stall heartbeat) must not keep the watch, and
with it the user's model, alive.
"""
from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from ...findings import Event
from ..integrations.instance_wrap import Patch, patch
from ..policy.policies import check_policy

if TYPE_CHECKING:
    from ...step.capture import MicroBatch
    from ..detectors.thresholds import WatchSettings
    from ..distributed import ranks
    from ..reads.history import GradHistory
    from .record import WatchRecord


class WatchGone(RuntimeError):
    """The watch this context belonged to was collected (a thread outlived it)."""


class WatchContext:
    """The watch as its components see it: what it watches, what it has read, and what they may ask of it."""

    def __init__(self, watch: WatchRecord):
        self._ref = weakref.ref(watch)

    @property
    def _watch(self) -> Any:
        watch = self._ref()
        if watch is None:
            raise WatchGone("the watch this component belonged to no longer exists")
        return watch

    @property
    def alive(self) -> bool:
        """The watch still exists (a component's thread asks before each look)."""
        return self._ref() is not None

    # ---- what the watch watches ----------------------------------------------------------------------
    @property
    def model(self) -> torch.nn.Module:
        return self._watch.model

    @property
    def trainer(self) -> Any:
        return self._watch.trainer

    @property
    def target(self) -> Any:
        return self._watch.target

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self._watch.optimizer

    @property
    def scaler(self) -> Any:
        return self._watch.scaler

    @property
    def policy(self) -> str:
        return self._watch.policy

    @property
    def settings(self) -> WatchSettings:
        return self._watch.settings

    # ---- what it has read ----------------------------------------------------------------------------
    @property
    def step(self) -> int:
        """The watch's optimizer step (0-based, skipped steps counted)."""
        return self._watch.step

    @property
    def history(self) -> GradHistory:
        return self._watch.history

    @property
    def events(self) -> list[Event]:
        return self._watch.events

    @property
    def micro_batches(self) -> tuple[MicroBatch, ...]:
        """This step's captured training micro-batches."""
        return tuple(self._watch._micro_batches)

    @property
    def bad_streak(self) -> int:
        """Non-finite steps in a row, this one included."""
        return self._watch._bad_streak

    @property
    def ranks(self) -> ranks.RankSync | None:
        """Across ranks, the step's agreement (rank, world size, ``smallest``); None on one process."""
        return self._watch._ranks

    @property
    def active(self) -> bool:
        """Attached and not stepped aside after an internal error."""
        return self._watch.active

    @property
    def uses_deepspeed(self) -> bool:
        """A DeepSpeed engine runs the step (it keeps the weights it updates in its own partitions)."""
        return self._watch._deepspeed is not None

    def device(self) -> torch.device:
        """The device the watch reads on (the first trainable parameter's)."""
        return self._watch._collector.device()

    # ---- what a component may ask ----------------------------------------------------------------------
    def emit(self, event: Event, agreed: bool = False) -> None:
        """Record ``event``; ``agreed``: decided from values every rank shares (one event on every rank)."""
        self._watch._emit(event, agreed=agreed)

    def fail(self, exc: BaseException, safe: bool = False) -> None:
        """An internal error in the component: recorded as a watch-error, and the watch steps aside (``safe``:
        at once; else at its next safe point, as inside torch's iteration over its own hook dicts)."""
        self._watch._fail(exc, safe=safe)

    def request_stop(self, event: Event | None, step_ended: bool = False) -> None:
        """End training (policy stop): a Trainer at this step's end, a plain loop with NonFiniteError."""
        self._watch._stop(event, step_ended=step_ended)

    def set_policy(self, policy: str) -> None:
        """Change the watch's policy (policy rewind falls back to skip where snapshots cannot work)."""
        self._watch.policy = check_policy(policy)

    def forget_bad_streak(self) -> None:
        """After a rewind the next bad step is trouble of its own."""
        self._watch._bad_streak = 0

    def rewound(self, step: int) -> None:
        """An earlier state was put back at ``step``: every component's baseline hears it."""
        self._watch._board.rewound(step)

    def name_rows(self, event: Event) -> None:
        """Name the rows that broke this step on ``event`` (a budget shared with the localiser's)."""
        self._watch._name_rows(event)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Forwards and backwards inside are the component's own (a replay), not the user's training."""
        with self._watch.paused():
            yield

    def patch(self, owner: Any, name: Any, around: Callable[..., Any]) -> Patch:
        """Wrap ``owner.name`` (an instance's method, a module's function, a list's item) with
        ``around(call, *args, **kwargs)`` through the one patch primitive (integrations/instance_wrap.py):
        found again and never stacked; a failure in ``around`` is this watch's internal error and the user's
        call still runs. ``remove()`` on the handle puts the original back."""
        return patch(owner, name, around, self.fail)
