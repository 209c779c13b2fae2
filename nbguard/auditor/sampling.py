"""Sample batches from a Trainer's own training dataloader without disturbing the run that follows.

The batch rules (labels, padding, supervision) are only as good as the batches they see, and the
batches that matter are the ones the Trainer will build: its dataset, its column removal, its
collator, its batch size. ``Trainer.get_train_dataloader()`` builds a fresh loader each call, so
sampling from one never advances the loader ``train()`` will build. What sampling does touch is
put back: every RNG the sampler or the collator may draw from (torch, CUDA, ``random``, NumPy) and
the accelerator's registry of prepared loaders and its gradient state.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..step.capture import preserved_rng

SAMPLE_BATCHES = 8  # enough to see a few percent of empty rows, cheap to collate


@dataclass
class BatchSample:
    """What the audit's batch rules look at, and where it came from."""

    batches: list[dict[str, torch.Tensor]] = field(default_factory=list)
    source: str = "none"  # "batch" (given to the audit), "trainer" (sampled) or "none"
    note: str | None = None  # why nothing was sampled, when nothing was
    error: str | None = None  # the exception the trainer's dataloader raised while sampling

    def to_evidence(self) -> dict[str, Any]:
        out: dict[str, Any] = {"batch_source": self.source, "batches_seen": len(self.batches)}
        if self.note:
            out["sampling_note"] = self.note
        return out


def _tensor_batch(batch: Any) -> dict[str, torch.Tensor] | None:
    if not isinstance(batch, Mapping):
        return None
    out = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
    return out or None


def forget_loader(trainer: Any, loader: Any) -> None:
    """Undo what ``accelerator.prepare`` and a half-consumed ``DataLoaderShard`` left behind."""
    end = getattr(loader, "end", None)
    if callable(end):  # an unfinished iteration stays the accelerator's "active dataloader" otherwise
        end()
    accelerator = getattr(trainer, "accelerator", None)
    registered = getattr(accelerator, "_dataloaders", None)
    if isinstance(registered, list):
        registered[:] = [d for d in registered if d is not loader]


def sample_trainer_batches(trainer: Any, count: int = SAMPLE_BATCHES) -> BatchSample:
    """Up to ``count`` batches from ``trainer.get_train_dataloader()``, the RNG left as it was."""
    if not isinstance(count, int) or count < 1:
        raise ValueError(f"count must be a positive int; got {count!r}")
    dataset = getattr(trainer, "train_dataset", None)
    if dataset is None:
        return BatchSample(note="the trainer has no train_dataset")
    if isinstance(dataset, torch.utils.data.IterableDataset):
        # A generator-backed stream may be one-shot: reading from it would take the user's examples.
        return BatchSample(note="train_dataset is an IterableDataset: not sampled, reading it could consume it")
    batches: list[dict[str, torch.Tensor]] = []
    with preserved_rng():
        loader = trainer.get_train_dataloader()
        iterator = iter(loader)
        try:
            for batch in iterator:
                tensors = _tensor_batch(batch)
                if tensors is not None:
                    batches.append(tensors)
                if len(batches) >= count:
                    break
        finally:
            close = getattr(iterator, "close", None)
            if callable(close):
                close()
            del iterator  # shuts down worker processes, if any
            forget_loader(trainer, loader)
    if not batches:
        return BatchSample(source="trainer", note="the trainer's dataloader gave no batch of tensors")
    return BatchSample(batches=batches, source="trainer")
