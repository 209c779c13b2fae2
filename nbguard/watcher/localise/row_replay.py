"""The replay of a step's micro-batches for their rows: each row's token losses on the weights as they are.

The micro-batches run once more, eagerly, in train mode, each with the RNG and autocast it was captured
with; without their labels (and TRL's fused LM head told not to fuse) the model returns logits, and each
row's loss is the token loss with ``reduction="none"`` over its supervised tokens. :mod:`.rows` names the
rows that broke a step with it, :mod:`.row_grads` takes their gradients through it, and policy rewind asks
it whether a snapshot's weights do better on a batch (:func:`batch_loss`).
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F

from ...introspect.modes import in_training_mode
from ...step.capture import MicroBatch, capture_rng, restore_rng
from ...step.eager import eager_everywhere, unwrap_compiled
from ...step.precision import autocast_as

IGNORE = -100
# what makes a forward compute its own loss: left out of a replay that wants the logits
LOSS_KWARGS = ("labels", "shift_labels", "num_items_in_batch", "fused_lm_head")


def token_losses(logits: torch.Tensor, labels: torch.Tensor, shifted: bool = False) \
        -> tuple[torch.Tensor, torch.Tensor] | None:
    """(each token's loss, whether it is supervised), shaped like the labels (a causal LM's shifted as it
    shifts them inside the model, unless ``shifted``: ``shift_labels`` are already); None for outputs that
    are not per-token or per-row logits."""
    if logits.dim() == 3 and labels.dim() == 2 and labels.shape == logits.shape[:2]:
        if not shifted:  # a causal LM's labels are shifted inside the model
            logits, labels = logits[:, :-1], labels[:, 1:]
    elif not (logits.dim() == 2 and labels.dim() == 1 and labels.shape[0] == logits.shape[0]):
        return None
    token = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1).long(),
                            reduction="none", ignore_index=IGNORE).reshape(labels.shape)
    return token, labels != IGNORE


def _per_row(logits: torch.Tensor, labels: torch.Tensor, shifted: bool = False) \
        -> tuple[torch.Tensor, torch.Tensor] | None:
    """(loss, supervised tokens) per row: the token loss averaged over the row's supervised tokens."""
    found = token_losses(logits, labels, shifted)
    if found is None:
        return None
    token, supervised = found
    if token.dim() == 1:
        return token, supervised.long()
    counts = supervised.sum(dim=1)
    # a NaN/inf on a supervised token stays in the sum (masking with where keeps ignored tokens out)
    total = torch.where(supervised, token, torch.zeros_like(token)).sum(dim=1)
    return total / counts.clamp_min(1), counts


@contextmanager
def replayed(model: torch.nn.Module, micro_batches: list[MicroBatch], grad: bool = False) \
        -> Iterator[Iterator[tuple[MicroBatch, torch.Tensor, torch.Tensor, bool]]]:
    """The step's micro-batches run once more, eagerly, in train mode, each with the RNG and autocast it was
    captured with: (micro-batch, logits, labels, whether the labels are already shifted) for each one with
    labels and logits. Without its labels the model returns logits (TRL's fused LM head, which computes the
    loss from the hidden states, is asked not to fuse). The RNG and the modules' train flags are put back
    on exit."""
    eager, _ = unwrap_compiled(model)
    rng = capture_rng(host=True)  # (a forward may draw from random or NumPy too: all put back)

    def outputs() -> Iterator[tuple[MicroBatch, torch.Tensor, torch.Tensor, bool]]:
        for mb in micro_batches:
            labels, shifted = mb.labels(), False
            if labels is None and isinstance(mb.kwargs.get("shift_labels"), torch.Tensor):
                labels, shifted = mb.kwargs["shift_labels"], True
            if labels is None:
                continue
            kwargs = {k: v for k, v in mb.kwargs.items() if k not in LOSS_KWARGS}
            restore_rng(mb.rng)
            with autocast_as(mb.autocast):
                output = eager(*mb.args, **kwargs)
            logits = getattr(output, "logits", None)
            if logits is None and isinstance(output, (tuple, list)) and output:
                logits = output[0]
            if isinstance(logits, torch.Tensor):
                yield mb, logits, labels.to(logits.device), shifted

    try:
        with in_training_mode(eager), eager_everywhere(), torch.set_grad_enabled(grad):
            yield outputs()
    finally:
        restore_rng(rng)


def row_losses(model: torch.nn.Module, micro_batches: list[MicroBatch]) -> list[dict[str, Any]]:
    """Each row's loss on these micro-batches, replayed eagerly without gradients."""
    found: list[dict[str, Any]] = []
    with replayed(model, micro_batches) as outputs:
        for mb, logits, labels, shifted in outputs:
            per_row = _per_row(logits, labels, shifted)
            if per_row is None:
                continue
            losses, counts = (t.tolist() for t in per_row)
            found += [{"micro_batch": mb.index, "row": r, "loss": float(v), "tokens": int(n)}
                      for r, (v, n) in enumerate(zip(losses, counts))]
    return found


def batch_loss(model: torch.nn.Module, micro_batches: list[MicroBatch]) -> float | None:
    """The micro-batches' loss over every supervised token (each row weighed by its tokens), replayed;
    None where no row has per-token labels; NaN/inf where a row's loss is."""
    rows = [r for r in row_losses(model, micro_batches) if r["tokens"] > 0]
    tokens = sum(r["tokens"] for r in rows)
    return sum(r["loss"] * r["tokens"] for r in rows) / tokens if tokens else None
