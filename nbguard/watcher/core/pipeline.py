"""The component pipeline: what a watch component is, the read-only view of a step it is given, and the
board that dispatches the watch's lifecycle points to the components that implement them.

Every part of the watch that is not its core is a :class:`WatchComponent`: the user's detectors, the
built-in ones, the update norms, the run checks, the rows a bad step names, every module of
:mod:`nbguard.watcher.components`. A
component overrides only the hooks it needs; the board calls a hook only on the components that
implement it, so a step pays for what it has. Lifecycle points (all optional): ``attach(context)`` /
``detach()`` with the watch, ``on_forward_start()`` (every forward of the watched model),
``on_train_begin()`` / ``on_train_end()`` (a loop starts and ends), ``on_micro_batch``,
``before_optimizer_step(step)`` / ``after_optimizer_step(step)`` around ``optimizer.step``, the step's
``scalars`` / ``before_update`` / ``update``, ``on_log``, ``reset_step`` and ``rewound``. The
:class:`~nbguard.watcher.core.context.WatchContext` given to ``attach`` is all a component may use of the watch.

A detector is the commonest component.

A detector is one class: it may ask for device scalars that ride along in the step's single host
read (``scalars``), judges the step at its end (``update``) and the trainer's logged metrics after
it (``on_log``: TRL's ``reward``, ``rewards/chosen``, ``eval_loss``...). It returns events whose
kinds are registered once with :func:`nbguard.document.register_event_kind`. The watch never
needs to know a detector's name: ``nbguard.watch(..., detectors=[...])`` or
``watch.add_detector(d)`` is the whole registration. See docs/guides/detectors.md.

A detector may also take part in the watch's policy (``warn``/``skip``/``stop``) without the core
knowing it: ``before_update`` sees a finite update before the optimizer applies it, and an event
for which ``drops_update(event)`` is true has that update dropped under ``skip`` and ``stop``
(``stop`` then ends training); an event from ``update`` for which ``stops_training(event)`` is true
ends training under ``stop`` once its step has ended. Across ranks the policy acts only on the
events of a detector whose ``agreed`` is true (decided from what every rank agreed on, so every
rank acts alike); its events are recorded as the same event on every rank. The watch's own
GradScaler skip streak (:mod:`.scaler_skips`) and run checks (:mod:`.components.run_checks`) are detectors.
"""
from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ...errors import NonFiniteError
from ...findings import Event

if TYPE_CHECKING:
    from ...step.capture import MicroBatch
    from ..reads.history import GradHistory


class WatchedRun(Protocol):
    """What a detector may read from the watch when it asks for scalars (a NanWatch is one)."""

    step: int
    model: torch.nn.Module

    def weight_fingerprint(self) -> torch.Tensor: ...


@dataclass(frozen=True)
class StepView:
    """One optimizer step as the detectors see it, after its one host read. Read-only."""

    step: int  # the watch's optimizer step (0-based, skipped steps counted)
    groups: tuple[str, ...]  # the parameter groups, in the order of ``grad_norm``
    grad_norm: tuple[float, ...]  # per group, pre-clip, unscaled, accumulated over micro-batches
    loss: float | None
    loss_scale: float | None
    skipped: bool  # the update was dropped (policy) or skipped (GradScaler)
    scaler_skipped: bool | None = None  # the GradScaler skipped this step (None: no GradScaler is bound)
    scalars: dict[str, list[float]] = field(default_factory=dict)  # what this detector asked for, by name
    history: GradHistory | None = None  # every earlier step (per-group norms, losses, scales, skips)
    # finite gradients whose fp32 norm overflowed: the groups, whether their norms are lower bounds,
    # the largest |g| (None where a clip zeroed them first); None on every other step
    norm_overflow: dict[str, Any] | None = None

    @functools.cached_property  # (several detectors ask, once per step)
    def total_grad_norm(self) -> float:
        return total_norm(self.grad_norm)

    @property
    def finite(self) -> bool:
        return all_finite(self.grad_norm) and (self.loss is None or math.isfinite(self.loss))

    def with_scalars(self, scalars: dict[str, list[float]]) -> StepView:
        """This view with one detector's scalars: a copy of its fields (``dataclasses.replace`` re-runs
        ``__init__`` through the field list, several times slower, inside the user's step)."""
        view = object.__new__(StepView)
        view.__dict__.update(self.__dict__)
        view.__dict__["scalars"] = scalars
        return view


# Over every step's values, inside the user's training step: map() and sum() over builtins run
# without a Python frame per value (a generator expression resumes one per value).
def total_norm(norms: Sequence[float]) -> float:
    """The 2-norm of per-group norms (the same sum, in the same order, as summing ``v * v``)."""
    return math.sqrt(sum(map(operator.mul, norms, norms)))


def all_finite(values: Iterable[float]) -> bool:
    return all(map(math.isfinite, values))


class WatchComponent:
    """Base of every watch component and detector (subclass it, override what you need; every method is optional).

    Methods run inside the user's training step: keep them host-side and cheap. An exception in
    one is caught: it is recorded as a ``watch-error`` event and the watch steps aside.
    """

    name = "detector"
    # Its events are decided from values every rank agreed on (the step's exchange, the GradScaler's
    # all-reduced found_inf): recorded as one agreed event, and the policy acts on them across ranks.
    agreed = False

    def attach(self, context: Any) -> None:  # a context.WatchContext (not imported: context.py builds on this)
        """The watch attaches (or the component is added to an attached watch): keep ``context``, start what runs
        beside training. Everything it starts must end in ``detach``."""

    def detach(self) -> None:
        """The watch detaches: undo what ``attach`` did (threads ended, patches removed)."""

    def on_forward_start(self) -> None:
        """A forward of the watched model starts (every one, training or not): keep it to a timestamp."""

    def on_train_begin(self) -> None:
        """A training loop starts (``Trainer.train()``)."""

    def on_train_end(self) -> None:
        """The training loop ended (``Trainer.train()`` returned)."""

    def before_optimizer_step(self, step: int) -> None:
        """``optimizer.step`` is about to run for the watch's step ``step`` (after the policy's decision)."""

    def after_optimizer_step(self, step: int) -> None:
        """``optimizer.step`` returned for step ``step``."""

    def step_payload(self, payload: dict[str, Any]) -> None:
        """The step ended and someone listens (a dashboard, a tracker): add what this component read to
        the step's payload (called only when the watch has listeners)."""

    def scalars(self, watch: WatchedRun) -> dict[str, torch.Tensor]:
        """Device tensors to fold into this step's single host read, by name (any shape, flattened).
        Their values come back in ``StepView.scalars[name]`` as a list of floats."""
        return {}

    def on_micro_batch(self, micro_batch: MicroBatch) -> None:
        """A training forward was captured (``micro_batch.index``, ``.labels()``, ``.kwargs``)."""

    def update(self, view: StepView) -> list[Event]:
        """The step ended: the events it shows (often none)."""
        return []

    def on_log(self, step: int, logs: dict[str, Any]) -> list[Event]:
        """The trainer logged metrics (``Trainer.log``: loss, learning rate, TRL's rewards, eval_loss)."""
        return []

    def before_update(self, view: StepView) -> list[Event]:
        """The step's update is finite and about to be applied (``view.skipped`` is False): the events
        found now, while the policy can still drop it. Called only where the watch checks updates
        before the optimizer moves (not under an enabled GradScaler, which decides itself)."""
        return []

    def drops_on_device(self, total: torch.Tensor, loss: torch.Tensor | None) -> torch.Tensor | None:
        """``read="deferred"`` under a policy that drops updates: whether ``before_update`` will drop this step's
        update, decided now from its total gradient norm and loss (0-d device tensors) as a 0-d bool device tensor
        (no host read), so the update is dropped on the device before it is applied. None: no opinion."""
        return None

    def drops_update(self, event: Event) -> bool:
        """Whether ``event`` (one ``before_update`` returned) drops the update under policy skip or stop;
        the event then carries ``update_dropped: True``, and under stop training ends."""
        return False

    def stops_training(self, event: Event) -> bool:
        """Whether ``event`` (one ``update`` returned) ends training under policy stop, after its step."""
        return False

    def reset_step(self) -> None:
        """A step (or ``train()``) starts, or an interrupted one is abandoned: forget per-step state."""

    def rewound(self, step: int) -> None:
        """Policy rewind put an earlier state back at ``step``: a baseline learned from the steps since that
        state (a dead run's zero updates, a climb's gradient norms) no longer describes the run."""


Detector = WatchComponent  # the name users subclass for their own detectors (docs/guides/detectors.md)


def check_detector(detector: Any) -> Detector:
    """A clear error for anything that is not a detector, before it is wired into a watch."""
    if isinstance(detector, type):
        raise TypeError(f"pass a detector instance, not the class {detector.__name__}: {detector.__name__}()")
    missing = [m for m in ("scalars", "update", "on_log", "reset_step") if not callable(getattr(detector, m, None))]
    if missing:
        raise TypeError(f"{type(detector).__name__} is not a detector: it lacks {', '.join(missing)}; subclass "
                        f"nbguard.watcher.Detector and override update(view) and/or on_log(step, logs)")
    return detector


# what a component may override; the board calls a hook only on the components that implement it (the
# base's methods do nothing), so a step pays for the components it has, not for the protocol
_HOOKS = ("attach", "detach", "on_forward_start", "on_train_begin", "on_train_end", "before_optimizer_step",
          "after_optimizer_step", "step_payload", "scalars", "on_micro_batch", "update", "before_update", "on_log", "reset_step",
          "drops_on_device",
          "rewound")


def _implements(detector: Any, hook: str) -> bool:
    method = getattr(type(detector), hook, None)
    if method is None or hook in getattr(detector, "__dict__", {}):  # duck-typed, or set on the instance
        return callable(getattr(detector, hook, None))
    return method is not getattr(WatchComponent, hook)


class DetectorBoard:
    """The watch's components, in order: collects their scalars for the read, hands out the values, and
    dispatches each lifecycle point to the components that implement it."""

    def __init__(self, detectors: list[Detector], last: list[Detector] | tuple[Detector, ...] = ()):
        """``last``: components that stay at the end of the list (an added one goes before them)."""
        self.detectors = [check_detector(d) for d in [*detectors, *last]]
        self._last = len(last)
        self._asked: list[tuple[Detector, str, int]] = []  # (detector, name, numel) in read order
        # hook -> (component, its bound method) for the components that implement it (bound once: a
        # step dispatches a dozen of them)
        self._by_hook: dict[str, list[tuple[Detector, Callable[..., Any]]]] = {}
        self.context: Any = None  # the watch's context.WatchContext, set while the watch is attached
        self._index_hooks()

    def add(self, detector: Detector) -> None:
        """A component joins (before the ``last`` ones); on an attached watch it is attached at once."""
        self.detectors.insert(len(self.detectors) - self._last, check_detector(detector))
        self._index_hooks()
        if self.context is not None and _implements(detector, "attach"):
            detector.attach(self.context)

    def _index_hooks(self) -> None:
        self._by_hook = {hook: [(d, getattr(d, hook)) for d in self.detectors if _implements(d, hook)]
                         for hook in _HOOKS}

    def attach(self, context: Any) -> None:  # a context.WatchContext (not imported: context.py builds on this)
        """Every component's ``attach``, in order; all or nothing: one that fails detaches those before it."""
        attached: list[Callable[[], None]] = []
        try:
            for detector, attach in self._by_hook["attach"]:
                attach(context)
                if _implements(detector, "detach"):
                    attached.append(detector.detach)
        except BaseException:
            for detach in reversed(attached):
                detach()
            raise
        self.context = context

    def detach(self) -> None:
        """Every component's ``detach``, last attached first; each runs even if one before it failed."""
        self.context = None
        failure: BaseException | None = None
        for _, detach in reversed(self._by_hook["detach"]):
            try:
                detach()
            except Exception as exc:  # the others still detach; the first failure is raised after
                failure = failure or exc
        if failure is not None:
            raise failure

    def dispatch(self, hook: str, *args: Any, on_error: Callable[[BaseException], None] | None = None) -> None:
        """A lifecycle point without events (forward start, loop begin/end, around the optimizer step);
        ``on_error``: a component's exception goes there and the next component still runs."""
        for _, method in self._by_hook[hook]:
            try:
                method(*args)
            except NonFiniteError:  # the stop policy ending a plain loop on purpose
                raise
            except Exception as exc:
                if on_error is None:
                    raise
                on_error(exc)

    def on_log(self, step: int, logs: dict[str, Any], emit: Callable[[Detector, Event], None]) -> None:
        for detector, on_log in self._by_hook["on_log"]:
            for event in on_log(step, dict(logs)):
                emit(detector, event)

    def on_micro_batch(self, micro_batch: MicroBatch) -> None:
        for _, on_micro_batch in self._by_hook["on_micro_batch"]:
            on_micro_batch(micro_batch)

    def collect(self, watch: WatchedRun) -> list[torch.Tensor]:
        """Every detector's scalars, in a stable order (the sentinel's read flattens and stacks them)."""
        self._asked, tensors = [], []
        for detector, scalars in self._by_hook["scalars"]:
            for name, tensor in scalars(watch).items():
                self._asked.append((detector, name, tensor.numel()))
                tensors.append(tensor)  # the read flattens each into its one cat
        return tensors

    def split(self, values: list[float] | None) -> dict[int, dict[str, list[float]]]:
        """The read's values back by id(detector), by name (in the order of the last ``collect``);
        only the detectors that asked this step."""
        by_detector: dict[int, dict[str, list[float]]] = {}
        at = 0
        for detector, name, n in self._asked:
            by_detector.setdefault(id(detector), {})[name] = list(values[at:at + n]) if values is not None else []
            at += n
        return by_detector

    def run(self, hook: str, view: StepView, values: list[float] | None,
            emit: Callable[[Detector, Event], None]) -> list[tuple[Detector, Event]]:
        """Every detector's ``hook`` (``"update"`` or ``"before_update"``) on ``view`` with its own
        scalars, in list order; each detector's events are emitted before the next one runs.
        Returns (detector, event) for each event, for the policy to decide on."""
        found: list[tuple[Detector, Event]] = []
        asked = self.split(values) if self._asked else {}
        for detector, method in self._by_hook[hook]:
            scalars = asked.get(id(detector))
            events = method(view if scalars is None else view.with_scalars(scalars))
            for event in events:
                emit(detector, event)
                found.append((detector, event))
        return found

    def drops_on_device(self, total: torch.Tensor, loss: torch.Tensor | None) -> torch.Tensor | None:
        """Whether any component's ``before_update`` will drop this update, as a device flag (None: none can)."""
        verdict = None
        for _, drops in self._by_hook["drops_on_device"]:
            flag = drops(total, loss)
            if flag is not None:
                verdict = flag if verdict is None else verdict | flag
        return verdict

    def reset_step(self) -> None:
        self._asked = []
        for _, reset_step in self._by_hook["reset_step"]:
            reset_step()

    def rewound(self, step: int) -> None:
        for _, rewound in self._by_hook["rewound"]:
            rewound(step)
