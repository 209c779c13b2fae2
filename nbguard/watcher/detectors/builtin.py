"""The watch's own detectors, written against the public pipeline (nothing here reaches into the core).

The non-finite check and the GradScaler skip streak stay in the step state machine: they decide
the policy (drop the update, stop) before the optimizer moves, and their events are localised by
replay. Everything that only reports goes through :class:`~nbguard.watcher.core.pipeline.Detector`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ...findings import Event
from ..core.pipeline import Detector, StepView, WatchedRun
from .eval_mode import TrainedInEvalMode
from .resume_check import ResumeCheck
from .skip_futility import SkipCannotSave
from .supervision import FewTokensDetector, supervision_fixes
from .thresholds import EvalLossDetector, FrozenDetector, WatchSettings

if TYPE_CHECKING:
    from ...step.capture import MicroBatch


class FrozenParams(Detector):
    """Every ``frozen_check_every`` steps a per-group weight fingerprint rides along in the read."""

    name = "frozen-params"

    def __init__(self, settings: WatchSettings):
        self.frozen = FrozenDetector(settings)

    def scalars(self, watch: WatchedRun) -> dict[str, torch.Tensor]:
        return {"fingerprint": watch.weight_fingerprint()} if self.frozen.due(watch.step) else {}

    def update(self, view: StepView) -> list[Event]:
        fingerprint = view.scalars.get("fingerprint")
        found = self.frozen.update(view.step, fingerprint) if fingerprint else None
        if found is None:
            return []
        return [Event("frozen-params", view.step, f"trainable weights have not changed for "
                      f"{found['steps_unchanged']} optimizer steps", evidence=found)]


class FrozenEvalLoss(Detector):
    """Bit-identical eval losses (from the trainer's logs) mean the weights are not changing."""

    name = "frozen-eval-loss"

    def __init__(self, settings: WatchSettings):
        self.evals = EvalLossDetector(settings)

    def on_log(self, step: int, logs: dict[str, Any]) -> list[Event]:
        if not isinstance(logs.get("eval_loss"), (int, float)):
            return []
        eval_loss = float(logs["eval_loss"])
        found = self.evals.update(eval_loss)
        if found is None:
            return []
        return [Event("frozen-eval-loss", step, f"eval loss is bit-identical across {found['evaluations']} "
                      f"evaluations ({eval_loss!r}): the weights are not changing", evidence=found)]


class FewSupervisedTokens(Detector):
    """One event for the first micro-batch built on few supervised tokens; later ones are counted on it."""

    name = "few-supervised-tokens"

    def __init__(self) -> None:
        self.few = FewTokensDetector()
        self.event: Event | None = None
        self.fixes: list[str] = []  # a micro-batch that scores no token: its cause's fixes (none in a plain loop)

    def attach(self, context: Any) -> None:
        self.fixes = supervision_fixes(context.trainer)

    def on_micro_batch(self, micro_batch: MicroBatch) -> None:
        self.few.capture(micro_batch.index, micro_batch.labels())

    def scalars(self, watch: WatchedRun) -> dict[str, torch.Tensor]:
        pending = self.few.pending()
        if not pending:
            return {}
        return {"supervised_tokens": pending[0].reshape(1) if len(pending) == 1 else torch.stack(pending)}

    def reset_step(self) -> None:
        self.few.reset()

    def update(self, view: StepView) -> list[Event]:
        found = self.few.update(view.scalars.get("supervised_tokens"))
        if found is None or (found["supervised_tokens"] == 0 and not view.finite):
            return []  # a 0/0 loss is already a non-finite event with cause no-supervised-tokens
        if self.event is not None:
            evidence = self.event.evidence
            evidence["occurrences"] += 1
            if len(evidence["steps"]) < self.few.settings.max_steps_listed:
                evidence["steps"].append(view.step)
            return []
        median = found["recent_median"]
        found.update(occurrences=1, steps=[view.step])
        if found["supervised_tokens"] == 0:
            found["fixes"] = list(self.fixes)
        self.event = Event(
            "few-supervised-tokens", view.step,
            f"micro-batch {found['micro_batch']}'s loss is built on {found['supervised_tokens']} supervised token(s)"
            + (f" (recent median {median:g})" if median is not None else ""), evidence=found)
        return [self.event]


def builtin_detectors(settings: WatchSettings) -> list[Detector]:
    # No ratio-only gradient spike check beside them: the run checks' divergence judges spikes against
    # the run's own noise (a memorising run's gradient norm swings 10x while its loss falls)
    return [FewSupervisedTokens(), FrozenParams(settings), FrozenEvalLoss(settings), SkipCannotSave(), ResumeCheck(),
            TrainedInEvalMode()]
