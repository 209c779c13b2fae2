"""The checks for runs that stop learning without a NaN, as one detector.

Every run gets the divergence and dead-run checks (:mod:`.divergence`); a TRL RL or preference
trainer also gets its reward, preference and ratio checks (:mod:`.rl`). They judge each optimizer
step once: before its update where the watch checks updates (``before_update``: an exploded update
is then dropped under policy skip/stop, like a non-finite one), else at its end (``update``); the
trainer's logged metrics through ``on_log``. A watch component (section ``run_checks`` of
``WatchConfig``, ``enabled``); it judges after every other component, and its attach/detach put TRL's
reward-function taps on and off. Nothing here touches the device but ``drops_on_device`` (read a step
late). Their verdicts are this rank's own, so across ranks they only report.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ...findings import EVENT_KIND_REGISTRY, Event
from ...introspect.trl import GENERATING, PREFERENCE, trl_stack
from ..core.context import WatchContext
from ..core.pipeline import StepView, WatchComponent
from ..core.registry import ComponentSetup, register_component
from ..detectors.divergence import RUN_FIXES, RunHealth
from ..detectors.divergence_device import explodes_on_device
from ..detectors.rl import KIND_FIXES, Found, TRLChecks
from ..detectors.supervision import supervision_fixes

# kind -> one line for the reference table of event kinds
EVENT_KINDS = {kind: EVENT_KIND_REGISTRY[kind].description for kind in (
    "divergence", "dead-run", "nonfinite-reward", "no-learning-signal", "completions-truncated",
    "no-preference-signal", "ratio-mismatch", "policy-collapse", "kl-at-start")}
FIXES = {"divergence": RUN_FIXES, "dead-run": RUN_FIXES, **KIND_FIXES}
# an RL event that explains why the run has no gradient: no generic dead-run event on top of it
EXPLAINS_DEAD = ("nonfinite-reward", "no-learning-signal", "no-preference-signal")


@dataclass(frozen=True)
class RunCheckSettings:
    """``WatchConfig(run_checks=...)``."""

    enabled: bool = True  # divergence, dead runs, and TRL's reward and preference checks

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise TypeError(f"run_checks must be True or False, got {type(self.enabled).__name__}")


class RunChecks(WatchComponent):
    name = "run-checks"

    def __init__(self, trainer: Any):
        stack = trl_stack(trainer) if trainer is not None else None
        # a GRPO generation with equal rewards, or a DPO pair with equal answers, has a zero gradient
        # by construction, and a DPO loss at ln 2 is the preference check's: theirs to explain
        self.health = RunHealth(zero_grad_expected=stack in GENERATING + PREFERENCE,
                                constant_expected=math.log(2) if stack == "dpo" else None,
                                loss_climbs=stack not in GENERATING + PREFERENCE)
        self.trl = TRLChecks(trainer, self._failed) if stack is not None else None
        # a dead run whose micro-batches score no token (rows of EOS alone, labels all -100) is the data's, not the LR's
        self.supervision_fixes = supervision_fixes(trainer)
        self.dead_explained = False
        self.checked = -1  # the step last judged
        self.context: WatchContext | None = None

    def attach(self, context: WatchContext) -> None:
        self.context = context
        if self.trl is not None:
            self.trl.bind()

    def detach(self) -> None:
        if self.trl is not None:
            self.trl.unbind()

    def _failed(self, exc: BaseException) -> None:
        """A reward tap failed: the watch's internal error (the user's reward still ran)."""
        if self.context is not None:
            self.context.fail(exc)

    def before_update(self, view: StepView) -> list[Event]:
        return self.update(view)

    def drops_on_device(self, total: torch.Tensor, loss: torch.Tensor | None) -> torch.Tensor | None:
        """Read a step late: the divergence test of the step in flight, on the device, against the bounds the
        steps judged so far set (a climb or a dead run spans steps: judged late, the next update dropped)."""
        bounds = self.health.divergence.bounds()
        return explodes_on_device(total, loss, bounds) if bounds is not None else None

    def drops_update(self, event: Event) -> bool:
        """An exploded (finite) update is dropped like a non-finite one: the weights stay the last good ones. So
        is the update of a run that learned and then died (an update too large saturated it): under rewind it
        goes back to before it died."""
        return event.kind == "divergence" or (event.kind == "dead-run" and event.evidence.get("began_at_step", 0) > 0)

    def update(self, view: StepView) -> list[Event]:
        """Once per optimizer step: the reward calls made during it, then the step's norms."""
        step = view.step
        if self.checked == step:
            return []
        self.checked = step
        found: list[Found] = []
        if self.trl is not None:
            found += self.trl.take()
            self.trl.step = step + 1  # reward calls from now on belong to the next step
        found += self.health.update(step, view.loss, view.groups, view.grad_norm, view.total_grad_norm,
                                    view.norm_overflow)
        return self._events(step, found)

    def on_log(self, step: int, logs: dict[str, Any]) -> list[Event]:
        """The trainer's logged metrics; ``step`` is the watch's last finished optimizer step."""
        if self.trl is None:
            return []
        return self._events(step, self.trl.on_log(step, logs))

    def _events(self, step: int, found: list[Found]) -> list[Event]:
        events = []
        for kind, message, evidence in found:
            if kind in EXPLAINS_DEAD:
                self.dead_explained = True
            if kind == "dead-run" and self.dead_explained:
                continue
            at = evidence.get("first_step", step) if kind == "nonfinite-reward" else step
            cause = None
            if kind == "dead-run" and self._scores_no_token():
                cause, message = "no-supervised-tokens", message + NOTHING_TO_LEARN
                evidence.update(supervised_tokens=0, fixes=list(self.supervision_fixes))
            else:  # the same dict: later calls are counted on it; a check may narrow its kind's fixes to its trainer's
                evidence["fixes"] = list(evidence.get("fixes") or FIXES.get(kind, []))
            events.append(Event(kind, at, message, cause=cause, evidence=evidence))
        return events

    def _scores_no_token(self) -> bool:
        """This step's micro-batches have labels and the loss scores none of them (after the causal shift). One
        host read per micro-batch, made once: when the dead run is reported."""
        batches = self.context.micro_batches if self.context is not None else ()
        return bool(batches) and all(mb.labels() is not None and mb.has_no_supervised_tokens() for mb in batches)


NOTHING_TO_LEARN = ("; the step's micro-batches score no token (every label -100 after the causal shift, as in rows of "
                    "EOS alone): there is nothing to learn, whatever the learning rate")


def _make(setup: ComponentSetup) -> RunChecks | None:
    return RunChecks(setup.trainer) if setup.settings.enabled else None


register_component("run_checks", _make, settings=RunCheckSettings, aliases={"run_checks": "enabled"}, last=True,
                   summary="divergence, dead runs, TRL's reward/preference/ratio checks (enabled=False: off)")
