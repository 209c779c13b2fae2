"""Ranks whose losses weigh their tokens unequally (transformers#39392).

Under DDP each rank's loss is, unless the loop says otherwise, the mean over its own supervised
tokens, and DDP averages the ranks' gradients. A token on a rank with few supervised tokens then
weighs more than one on a rank with many: the gradient is not the one a single process would take
over the same rows, where every token weighs alike. The Trainer avoids it with
``average_tokens_across_devices=True`` (it divides by every rank's tokens); a plain loop that passes
``num_items_in_batch`` is taken to normalise itself.

Each rank's count rides in the step's one exchange (``distributed.RankSync``: a fourth float per
rank), so every rank judges the same numbers and reports the same event, with no extra collective.
"""
from __future__ import annotations

from typing import Any

import torch

from ...findings import Event
from ..detectors.supervision import supervised_count

# a token on the fewest-token rank weighs this many times one on the most-token rank
IMBALANCE = 2.0
MAX_STEPS_LISTED = 20


def step_supervised_tokens(micro_batches: list[Any]) -> torch.Tensor | None:
    """This rank's supervised tokens over the step's micro-batches, on the device (None: no token labels)."""
    counts = []
    for micro_batch in micro_batches:
        labels = micro_batch.labels()
        if isinstance(labels, torch.Tensor) and not labels.is_floating_point() and labels.dtype != torch.bool:
            counts.append(supervised_count(labels))
    if not counts:
        return None
    return counts[0] if len(counts) == 1 else torch.stack(counts).sum()


def losses_are_rank_means(trainer: Any, micro_batches: list[Any]) -> bool:
    """Whether each rank's loss is a mean over its own tokens (what makes uneven counts weigh unequally)."""
    args = getattr(trainer, "args", None)
    if args is not None and hasattr(args, "average_tokens_across_devices"):
        return not args.average_tokens_across_devices
    return not any("num_items_in_batch" in getattr(mb, "kwargs", {}) for mb in micro_batches)


class RankTokenBalance:
    """One ``rank-token-imbalance`` event for the first step whose ranks weigh tokens IMBALANCE apart;
    later such steps are counted on it."""

    def __init__(self) -> None:
        self.event: Event | None = None

    def judge(self, step: int, tokens: list[float], rank_means: bool, trainer: bool) -> Event | None:
        if not rank_means or len(tokens) < 2 or any(t < 0 for t in tokens):
            return None  # normalised across ranks, one rank, or a rank without token labels
        fewest, most = min(tokens), max(tokens)
        if fewest <= 0 or most / fewest < IMBALANCE:
            return None  # a rank with none has a 0/0 loss: the non-finite path names it
        ratio = most / fewest
        if self.event is not None:
            evidence = self.event.evidence
            evidence["occurrences"] += 1
            evidence["worst_ratio"] = max(evidence["worst_ratio"], ratio)
            if len(evidence["steps"]) < MAX_STEPS_LISTED:
                evidence["steps"].append(step)
            return None
        light, heavy = tokens.index(most), tokens.index(fewest)
        fix = ("set average_tokens_across_devices=True in TrainingArguments" if trainer else
               "divide the summed token loss by every rank's supervised tokens (all_reduce the count) and "
               "multiply by the world size, or pass num_items_in_batch=<that count> to the model")
        self.event = Event(
            "rank-token-imbalance", step,
            f"rank {heavy} trained on {fewest:g} supervised token(s) and rank {light} on {most:g}: each rank's loss "
            f"is a mean over its own tokens and DDP averages the ranks' gradients, so one of rank {heavy}'s tokens "
            f"counts {ratio:.1f}x one of rank {light}'s (a single process would weigh them alike). To weigh every "
            f"token alike, {fix}",
            evidence={"tokens_by_rank": [int(t) for t in tokens], "ratio": ratio, "worst_ratio": ratio,
                      "occurrences": 1, "steps": [step], "threshold": IMBALANCE})
        return self.event
