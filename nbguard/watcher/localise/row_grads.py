"""Each row's share of an exploded step's gradient norm: which rows pulled the update.

On a divergence the losses alone can mislead (a long row with a high loss may pull little; a short
row the model is certain of and wrong about can pull most). Here each micro-batch of the step is
replayed once more, eagerly and with the RNG it was captured with, and each row's gradient (of the
sum of its token losses, over the trainable weights) is taken with ``torch.autograd.grad`` from the
one forward, its norm read, and the gradient freed before the next row: the memory of one step's
gradients, which the dropped update freed. A row's share is its norm over the sum of the rows' norms
(the step's loss weighs every supervised token alike, so each row's gradient is weighed by its tokens
already). Bounded: at most ``MOST_ROWS`` rows, else none (the event says why).
"""
from __future__ import annotations

import torch

from ...step.capture import MicroBatch
from ...step.eager import unwrap_compiled
from .row_replay import replayed, token_losses

MOST_ROWS = 64  # rows replayed with a backward each; a step with more is not split


def row_grad_shares(model: torch.nn.Module, micro_batches: list[MicroBatch]) \
        -> tuple[dict[tuple[int, int], float], str | None]:
    """({(micro_batch, row): share of the step's gradient norm}, why not where none could be taken)."""
    rows = sum(int(labels.shape[0]) for labels in (mb.labels() for mb in micro_batches)
               if labels is not None and labels.dim() == 2)
    if rows == 0:
        return {}, "no micro-batch with per-row labels was captured"
    if rows > MOST_ROWS:
        return {}, f"the step has {rows} rows; a backward per row is taken for at most {MOST_ROWS}"
    params = [p for p in unwrap_compiled(model)[0].parameters() if p.requires_grad]
    if not params:
        return {}, "no trainable parameters"
    norms: dict[tuple[int, int], float] = {}
    with replayed(model, micro_batches, grad=True) as outputs:
        for mb, logits, labels, shifted in outputs:
            found = token_losses(logits, labels, shifted)
            if found is None or found[0].dim() != 2:
                continue
            token, supervised = found
            sums = torch.where(supervised, token, torch.zeros_like(token)).sum(dim=1)
            for r in range(sums.shape[0]):
                grads = [g for g in torch.autograd.grad(sums[r], params, retain_graph=r + 1 < sums.shape[0],
                                                        allow_unused=True) if g is not None]
                norms[(mb.index, r)] = float(torch.linalg.vector_norm(
                    torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))) if grads else 0.0
                del grads  # one row's gradients at a time
    total = sum(norms.values())
    if not norms or not total > 0:
        return {}, "every row's gradient is 0"
    return {key: value / total for key, value in norms.items()}, None
