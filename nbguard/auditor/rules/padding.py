"""Left padding in training: query rows of the 4-D attention mask that see no key at all.

With causal attention, a left-padded row's pad positions come first, so each pad query's keys
(itself and what precedes it) are all padding. The softmax over such a row is undefined: a plain
softmax over -inf (hand-written attention, older torch SDPA) gives NaN, and NaN * 0 in the
backward then poisons every gradient; transformers' eager attention masks with the dtype's finite
minimum, so the row spreads uniformly over every key, future tokens included; current torch SDPA
returns zeros for the row (observed on CPU with torch 2.13, fp32/fp16/bf16: no NaN, but the loss
differs between eager and sdpa). Whatever the kernel does, the last pad position is where a causal
LM predicts the row's first real token, so that label is learned from a row that saw nothing of
the sequence. Right padding puts the pad queries after real tokens: every row sees something.
"""
from __future__ import annotations

import copy

import torch

from ..registry import capped, finding, rule
from .batch import IGNORE_INDEX

# Implementations that drop padding before attention (varlen kernels): no 4-D mask, no empty rows.
UNPADDING_IMPLEMENTATIONS = ("flash_attention_2", "flash_attention_3")


def _attn_implementation(config) -> str | None:
    return getattr(config, "_attn_implementation", None) if config is not None else None


def model_attention_mask(config, attention_mask: torch.Tensor) -> torch.Tensor:
    """The boolean (batch, 1, query, key) mask the model builds for its full-attention layers (True = attend).

    transformers' own ``create_causal_mask`` builds it, on a shallow copy of the config set to sdpa
    so the mask is materialised as booleans whatever kernel the model really uses.
    """
    from transformers.masking_utils import create_causal_mask

    cfg = copy.copy(config)
    cfg._attn_implementation = "sdpa"
    batch, length = attention_mask.shape
    embeds = torch.empty((batch, length, 1), device=attention_mask.device)  # only its shape and device are read
    try:
        mask = create_causal_mask(cfg, embeds, attention_mask, None, allow_is_causal_skip=False)
    except TypeError:  # before 5.2x: no such argument, and a mask with padding in it is always materialised
        mask = create_causal_mask(cfg, embeds, attention_mask, None)
    if mask is None:  # sdpa's is_causal path: a plain causal mask, every query sees itself
        return torch.ones((batch, 1, length, length), dtype=torch.bool, device=attention_mask.device).tril()
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() != 4:
        raise RuntimeError(f"create_causal_mask returned {type(mask).__name__}, not a boolean 4-D mask")
    return mask


def masked_query_rows(config, attention_mask: torch.Tensor) -> tuple[torch.Tensor, str]:
    """(batch, query) booleans, True where the query attends to no key, and where the mask came from.

    Releases without ``masking_utils`` (before 4.53) or with another signature get the same causal x
    padding product derived here: a query sees nothing when no key at or before it is real.
    """
    try:
        mask = model_attention_mask(config, attention_mask)
    except (ImportError, TypeError):
        return attention_mask.cumsum(dim=-1) == 0, "causal x padding (derived)"
    return ~mask.any(dim=-1).any(dim=1), "transformers.masking_utils.create_causal_mask"


@rule("left-padding-training", "warning")
def left_padding_training(ctx):
    """Padded query rows of the model's 4-D causal mask that attend to nothing (left padding in training)."""
    impl = _attn_implementation(ctx.text_config)
    if ctx.text_config is None or impl in UNPADDING_IMPLEMENTATIONS:
        return None
    if not getattr(ctx.text_config, "is_causal", True) or getattr(ctx.config, "is_encoder_decoder", False):
        return None
    rows, positions, supervised, source = [], 0, 0, None
    for b, batch in enumerate(ctx.batches):
        mask2d = batch.get("attention_mask")
        if not isinstance(mask2d, torch.Tensor) or mask2d.dim() != 2 or bool(mask2d.all()):
            continue
        empty, source = masked_query_rows(ctx.text_config, mask2d.to(torch.long))
        # A row whose attention_mask is all 0 is the fully-masked-rows finding; here: rows with real tokens.
        real = mask2d.bool().any(dim=1)
        empty = empty & real[:, None]
        if not bool(empty.any()):
            continue
        positions += int(empty.sum())
        rows += [r if len(ctx.batches) == 1 else [b, r] for r in empty.any(dim=1).nonzero().flatten().tolist()]
        labels = batch.get("labels")
        if isinstance(labels, torch.Tensor) and labels.shape == mask2d.shape:
            # A causal LM's logits at position t are scored against labels[t + 1].
            supervised += int((empty[:, :-1] & (labels[:, 1:] != IGNORE_INDEX)).sum())
    if not rows:
        return None
    tok = ctx.tokenizer
    evidence = {"rows": capped(rows), "masked_query_positions": positions,
                "supervised_from_masked_rows": supervised, "attn_implementation": impl, "mask_source": source,
                "padding_side": getattr(tok, "padding_side", None), **ctx.sample.to_evidence()}
    return finding(
        "left-padding-training",
        f"{len(rows)} left-padded row(s): {positions} query position(s) attend to nothing",
        "In the causal x padding mask the model builds, these padded query positions have every key masked. "
        "Their softmax is undefined: a plain softmax over -inf (hand-written attention, older torch SDPA) gives "
        "NaN, which the backward spreads to every gradient (NaN * 0 is NaN); transformers' eager attention spreads "
        "them over every key, future tokens included, and current torch SDPA zeroes them. "
        f"{supervised} label(s) are predicted from such a position (the first real token after the padding). "
        "Pad on the right for training (tokenizer.padding_side = 'right'); keep left padding for batched generation.",
        evidence, fixes=["pad-right-for-training"],
    )
