"""Packed / padding-free batches whose attention lets one sample see another.

A packed row holds several examples, told apart by ``position_ids`` that restart at 0. transformers
(4.5x and later) turns such position_ids into a block-diagonal mask only when no 2-D attention_mask
is passed (``masking_utils.find_packed_sequence_indices``); a collator that also returns an all-ones
attention_mask, an older release or a model that builds its own mask gives plain causal attention
across the whole row: each example attends to the ones packed before it and the loss trains on the
mix. The rule asks transformers' own ``create_causal_mask`` for the mask the model will use and
counts the query/key pairs that cross an example boundary. Flash-attention kernels take packing from
``position_ids`` / ``cu_seq_lens`` and are not checked here (CUDA-only).
"""
from __future__ import annotations

import copy
from inspect import signature
from typing import Any

import torch

from ..registry import capped, finding, rule
from .padding import UNPADDING_IMPLEMENTATIONS, _attn_implementation


def segment_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """(batch, seq) example index within each row: a new example starts wherever the position does not go up by 1."""
    step = torch.ones_like(position_ids)
    step[:, 1:] = (position_ids[:, 1:] - position_ids[:, :-1] != 1).long()
    step[:, 0] = 0
    return step.cumsum(dim=1)


def cross_example_pairs(config, batch: dict) -> torch.Tensor | None:
    """(batch,) count of (query, key) pairs the model's mask allows across packed examples; None when not packed."""
    ids, positions = batch.get("input_ids"), batch.get("position_ids")
    if not isinstance(ids, torch.Tensor) or not isinstance(positions, torch.Tensor) or ids.dim() != 2:
        return None
    positions = positions.expand(ids.shape[0], -1) if positions.shape[0] != ids.shape[0] else positions
    segments = segment_ids(positions)
    mask2d = batch.get("attention_mask")
    mask2d = mask2d if isinstance(mask2d, torch.Tensor) and mask2d.shape == ids.shape else None
    real = mask2d.bool() if mask2d is not None else torch.ones_like(ids, dtype=torch.bool)
    # Padding after the last example restarts positions too: only boundaries between real tokens count.
    if not bool(((segments != segments[:, :1]) & real).any()):
        return None
    mask = _model_mask(config, ids, mask2d, positions)
    crossing = segments[:, :, None] != segments[:, None, :]
    both_real = real[:, :, None] & real[:, None, :]
    return (mask[:, 0] & crossing & both_real).sum(dim=(1, 2))


def _model_mask(config, ids: torch.Tensor, mask2d: torch.Tensor | None, positions: torch.Tensor) -> torch.Tensor:
    """The boolean (batch, 1, q, k) mask transformers builds from these inputs (sdpa/eager follow the same one).
    Releases before masking_utils (or its position_ids argument) read no example boundary: plain causal."""
    causal = torch.ones((ids.shape[0], 1, ids.shape[1], ids.shape[1]), dtype=torch.bool, device=ids.device).tril()
    try:
        from transformers.masking_utils import create_causal_mask

        cfg = copy.copy(config)
        cfg._attn_implementation = "sdpa"
        embeds = torch.empty((*ids.shape, 1), device=ids.device)  # only its shape and device are read
        # allow_is_causal_skip came after 5.9; without it a None mask means sdpa's plain causal path
        skip: dict[str, Any] = {"allow_is_causal_skip": False} if "allow_is_causal_skip" in signature(create_causal_mask).parameters \
            else {}
        mask = create_causal_mask(cfg, embeds, mask2d, None, position_ids=positions, **skip)
    except (ImportError, TypeError):
        return causal
    if mask is None:  # sdpa's is_causal path
        return causal
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise RuntimeError(f"create_causal_mask returned {type(mask).__name__}, not a boolean mask")
    return mask


@rule("packed-samples-attend-across", "error")
def packed_samples_attend_across(ctx):
    """Packed rows (position_ids restart) whose attention mask lets each example attend to the examples before it."""
    config = ctx.text_config
    if config is None or _attn_implementation(config) in UNPADDING_IMPLEMENTATIONS:
        return None
    rows, pairs, with_mask = [], 0, False
    for b, batch in enumerate(ctx.batches):
        counts = cross_example_pairs(config, batch)
        if counts is None or not bool(counts.any()):
            continue
        with_mask = with_mask or isinstance(batch.get("attention_mask"), torch.Tensor)
        pairs += int(counts.sum())
        rows += [[b, r] for r in counts.nonzero().flatten().tolist()]
    if not rows:
        return None
    return finding(
        "packed-samples-attend-across", f"{len(rows)} packed row(s): examples attend to the examples packed before them",
        "position_ids restart inside these rows (several examples packed into one), but the mask the model builds "
        f"is causal over the whole row: {pairs} query/key pairs cross an example boundary. "
        + ("The batch also carries a 2-D attention_mask, and transformers only derives the per-example blocks from "
           "position_ids when attention_mask is None. " if with_mask else
           "This model or transformers release does not derive per-example blocks from position_ids. ")
        + "Each example is trained conditioned on unrelated ones (the loss differs from the unpacked loss). Drop "
          "attention_mask from packed batches (padding-free collators return position_ids only), or use a "
          "flash-attention implementation that reads position_ids.",
        {"rows": capped(rows), "cross_example_pairs": pairs, "attention_mask_in_batch": with_mask,
         "attn_implementation": _attn_implementation(config), **ctx.sample.to_evidence()},
        fixes=["drop-mask-for-packing"] if with_mask else [])
