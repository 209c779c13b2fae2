"""Rules about what the labels teach: an end-of-sequence token that is never a target, labels shifted twice."""
from __future__ import annotations

from typing import Any

import torch

from ..registry import finding, rule
from .batch import IGNORE_INDEX, _is_causal_lm

MIN_POSITIONS = 8  # supervised positions needed before calling the labels shifted
SHIFTED_SHARE = 0.9  # share of labels equal to the NEXT input token that means "already shifted"


def _ids(value: Any) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, (list, tuple, set)):
        return {int(v) for v in value if v is not None}
    return {int(value)}


def eos_and_pad_ids(ctx) -> tuple[set[int], int | None]:
    """The EOS id(s) and the pad id: the tokenizer's when the audit can reach one, else the model's config."""
    tok = ctx.tokenizer
    eos = _ids(getattr(tok, "eos_token_id", None)) if tok is not None else set()
    pad = getattr(tok, "pad_token_id", None) if tok is not None else None
    for cfg in (getattr(ctx.model, "generation_config", None), *ctx.configs):
        if not eos:
            eos = _ids(getattr(cfg, "eos_token_id", None))
        if pad is None and tok is None:
            pad = getattr(cfg, "pad_token_id", None)
    return eos, pad


def _pairs(ctx) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    out = []
    for batch in ctx.batches:
        ids, labels, mask = batch.get("input_ids"), batch.get("labels"), batch.get("attention_mask")
        if (isinstance(ids, torch.Tensor) and isinstance(labels, torch.Tensor) and ids.dim() == 2
                and ids.shape == labels.shape):
            out.append((ids, labels, mask if isinstance(mask, torch.Tensor) and mask.shape == ids.shape else None))
    return out


@rule("eos-never-supervised", "warning")
def eos_never_supervised(ctx):
    """No label is the end-of-sequence token, typically because pad_token_id == eos_token_id and the collator masks pads."""
    pairs = _pairs(ctx)
    eos, pad = eos_and_pad_ids(ctx)
    if not pairs or not eos:
        return None
    def is_eos(t: torch.Tensor) -> torch.Tensor:
        return torch.isin(t, torch.tensor(sorted(eos), device=t.device))  # batches may sit on the GPU

    in_labels = sum(int(is_eos(labels).sum()) for _, labels, _ in pairs)
    if in_labels:
        return None
    # EOS tokens the model reads (attention_mask 1) whose label was masked: real ends of examples, never a target.
    masked_ends = sum(int((is_eos(ids) & (labels == IGNORE_INDEX)
                           & (mask.bool() if mask is not None else True)).sum()) for ids, labels, mask in pairs)
    pad_is_eos = pad is not None and pad in eos
    if not (pad_is_eos or masked_ends):
        return None  # no EOS anywhere and a distinct pad: nothing says the examples were meant to end with one
    return finding(
        "eos-never-supervised",
        "no label is the end-of-sequence token: the model never learns to stop",
        ("pad_token_id is the EOS id, so a collator that masks pad labels (DataCollatorForLanguageModeling does "
         "labels[labels == pad_token_id] = -100) masks every EOS too. " if pad_is_eos else
         "The examples' EOS tokens are in the inputs but their labels are -100. ")
        + "The loss never rewards predicting EOS, so the fine-tuned model keeps generating past the answer. "
          "Give the tokenizer a distinct pad token (or a collator that keeps EOS labels).",
        {"eos_token_id": sorted(eos), "pad_token_id": pad, "pad_is_eos": pad_is_eos, "eos_in_labels": 0,
         "eos_read_but_unlabelled": masked_ends, **ctx.sample.to_evidence()},
        fixes=["distinct-pad-token"] if pad_is_eos else [],
    )


@rule("labels-shifted-twice", "error")
def labels_shifted_twice(ctx):
    """Labels already shifted left by the data (labels[t] == input_ids[t+1]) while the causal LM shifts them again."""
    if not _is_causal_lm(ctx):
        return None
    positions = next_matches = same_matches = 0
    for ids, labels, _ in _pairs(ctx):
        if ids.shape[1] < 2:
            continue
        lab = labels[:, :-1]
        scored = lab != IGNORE_INDEX
        positions += int(scored.sum())
        next_matches += int(((lab == ids[:, 1:]) & scored).sum())
        same_matches += int(((lab == ids[:, :-1]) & scored).sum())
    if positions < MIN_POSITIONS:
        return None
    next_share, same_share = next_matches / positions, same_matches / positions
    if next_share < SHIFTED_SHARE or same_share >= 0.5:
        return None
    return finding(
        "labels-shifted-twice",
        f"labels are already shifted: {next_share:.0%} of them equal the NEXT input token",
        "On the supervised positions, labels[t] == input_ids[t+1]: the data was shifted for next-token "
        "prediction, and a transformers causal LM shifts labels again inside its loss, so position t is "
        "trained to predict the token two steps ahead. The loss still falls, but the model learns the wrong "
        "task. Pass labels aligned with input_ids (labels = input_ids, with -100 where not supervised).",
        {"supervised_positions": positions, "share_equal_to_next_input": next_share,
         "share_equal_to_same_input": same_share, **ctx.sample.to_evidence()},
        fixes=["unshift-labels"],
    )
