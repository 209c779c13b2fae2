"""Micro-batches whose loss is built on few supervised tokens.

A completion-only pipeline that cuts the answer away, or a batch of mostly-prompt rows, leaves a
micro-batch with a handful of labels (or none). Its mean loss then weighs as much as a full
micro-batch's while resting on a few tokens (a noisy, outsized update), or under
``num_items_in_batch`` contributes nothing at all; with none and a mean loss it is 0/0.

Cost: the count is one reduction on the device when the micro-batch is captured; the counts ride
along in the sentinel's one host read of the step (``StepStats.extra``): no extra sync.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ...step.capture import supervised_mask
from ..reads.rolling import RollingMedian


@dataclass
class SupervisionSettings:
    few_share: float = 0.1  # fewer than this share of the recent median count of supervised tokens is "few"
    min_history: int = 8  # micro-batches seen before a count is compared with the median (0 tokens: always)
    window: int = 256  # micro-batches the median is taken over
    max_steps_listed: int = 20


def supervised_count(labels: torch.Tensor) -> torch.Tensor:
    """Labels the loss scores (after the causal shift: ``supervised_mask``, one-token rows score 0), on the device."""
    return torch.count_nonzero(supervised_mask(labels))  # one reduction kernel (a bool sum takes two ops' setup)


def supervision_fixes(trainer: Any) -> list[str]:
    """The fixes of a step that scores no token: those its cause ``no-supervised-tokens`` offers (the fix registry's
    ``treats``; the watch does not import it). ``drop-unsupervised-rows`` filters a Trainer's data: a plain loop
    (``trainer`` None) gets none."""
    return ["drop-unsupervised-rows"] if trainer is not None else []


class FewTokensDetector:
    """Counts each training micro-batch's supervised tokens; reports the first micro-batch with few, then counts."""

    def __init__(self, settings: SupervisionSettings | None = None):
        self.settings = settings or SupervisionSettings()
        self.recent = RollingMedian(self.settings.window)
        self._pending: list[tuple[int, torch.Tensor]] = []

    def capture(self, index: int, labels: torch.Tensor | None) -> None:
        if not isinstance(labels, torch.Tensor) or labels.is_floating_point() or labels.dtype == torch.bool:
            return  # regression targets or masks: there are no tokens to count
        self._pending.append((index, supervised_count(labels)))

    def pending(self) -> list[torch.Tensor]:
        """This step's counts, still on the device: the sentinel reads them with everything else."""
        return [count for _, count in self._pending]

    def reset(self) -> None:
        self._pending = []

    def update(self, values: list[float] | None) -> dict[str, Any] | None:
        """With this step's counts as read by the sentinel: evidence for the fewest-token micro-batch, if few."""
        indices = [index for index, _ in self._pending]
        self._pending = []
        if not values or len(values) != len(indices):
            return None
        counts = [(index, int(value)) for index, value in zip(indices, values)]
        worst: dict[str, Any] | None = None
        for index, count in counts:
            enough = len(self.recent) >= self.settings.min_history
            median = self.recent.median() if self.recent else None
            few = count == 0 or (enough and median is not None and count < self.settings.few_share * median)
            if few and (worst is None or count < worst["supervised_tokens"]):
                worst = {"micro_batch": index, "supervised_tokens": count, "recent_median": median,
                         "step_counts": [c for _, c in counts]}
            self.recent.append(count)
        return worst
