"""Vision-language batches: image placeholders cut by truncation, labels that supervise placeholders or hold bad ids.

The processor expands each image into as many placeholder tokens as the vision tower gives features
(Qwen2-VL: ``t*h*w / spatial_merge_size**2`` from ``image_grid_thw``; LLaVA / Gemma 3 style: a fixed
``image_seq_length`` / ``mm_tokens_per_image`` per image). Truncating the text afterwards cuts some of
them and the forward raises "Image features and image tokens do not match" (LlamaFactory#5964). Labels
equal to the image token id train the model to emit placeholders; negative labels other than -100
make cross-entropy fail ("Target -1 is out of bounds", a device-side assert on CUDA).
"""
from __future__ import annotations

import torch

from ..registry import capped, finding, rule
from .batch import IGNORE_INDEX


def image_token_id(ctx) -> int | None:
    for cfg in ctx.configs:
        for name in ("image_token_id", "image_token_index"):
            value = getattr(cfg, name, None)
            if isinstance(value, int):
                return value
    return None


def expected_image_tokens(ctx, batch: dict) -> int | None:
    """The placeholder count the vision tower's features need for this batch's images; None when unknown."""
    grid = batch.get("image_grid_thw")
    if isinstance(grid, torch.Tensor) and grid.dim() == 2:
        merge = getattr(getattr(ctx.config, "vision_config", None), "spatial_merge_size", 1) or 1
        return int(grid.prod(dim=-1).sum()) // (merge * merge)
    pixels = batch.get("pixel_values")
    per_image = next((getattr(c, n) for c in ctx.configs for n in ("mm_tokens_per_image", "image_seq_length")
                      if isinstance(getattr(c, n, None), int)), None)
    if isinstance(pixels, torch.Tensor) and pixels.dim() == 4 and per_image:
        return int(pixels.shape[0]) * per_image
    return None


@rule("vlm-image-tokens-truncated", "error")
def vlm_image_tokens_truncated(ctx):
    """Batches whose image placeholder tokens are fewer (or more) than the images' features: truncation cut them."""
    token = image_token_id(ctx)
    if token is None:
        return None
    bad = []
    for b, batch in enumerate(ctx.batches):
        ids, expected = batch.get("input_ids"), expected_image_tokens(ctx, batch)
        if isinstance(ids, torch.Tensor) and expected is not None:
            tokens = int((ids == token).sum())
            if tokens != expected:
                bad.append({"batch": b, "image_tokens": tokens, "image_features": expected})
    if not bad:
        return None
    first = bad[0]
    return finding(
        "vlm-image-tokens-truncated",
        f"image placeholders cut: {first['image_tokens']} image tokens for {first['image_features']} image features",
        "The processor wrote one placeholder per image feature, but the batch holds fewer: truncation (max_length, "
        "max_seq_length) cut the text after the placeholders were expanded. The forward raises \"Image features and "
        f"image tokens do not match: tokens: {first['image_tokens']}, features {first['image_features']}\". Raise "
        "max_length above the longest example with its image tokens, drop examples that do not fit, or truncate the "
        "text before the processor expands the images (never after).",
        {"batches": capped(bad), "image_token_id": token, **ctx.sample.to_evidence()})


@rule("vlm-labels-bad-ids", "error")
def vlm_labels_bad_ids(ctx):
    """Labels that supervise the image placeholder token, or negative labels other than -100."""
    token = image_token_id(ctx)
    labels = [b["labels"] for b in ctx.batches if isinstance(b.get("labels"), torch.Tensor)]
    if not labels:
        return None
    negative = sorted({int(v) for lab in labels for v in lab[(lab < 0) & (lab != IGNORE_INDEX)].unique().tolist()})
    placeholders = sum(int((lab == token).sum()) for lab in labels) if token is not None else 0
    if not negative and not placeholders:
        return None
    said = []
    if negative:
        said.append(f"negative label ids other than -100 ({', '.join(map(str, negative[:5]))}): cross-entropy only "
                    "ignores -100, so it fails (\"Target -1 is out of bounds\" on CPU, a device-side assert on CUDA)")
    if placeholders:
        said.append(f"{placeholders} label(s) equal to the image token id {token}: the model is trained to emit image "
                    "placeholders, which it never sees as targets at inference")
    return finding(
        "vlm-labels-bad-ids", "labels hold " + (" and ".join(["negative ids"] * bool(negative) + ["image tokens"] * bool(placeholders))),
        "The sampled labels hold " + "; and ".join(said) + ". Set those labels to -100 in the collator.",
        {"negative_ids": negative, "image_token_labels": placeholders, "image_token_id": token,
         **ctx.sample.to_evidence()},
        severity="error" if negative else "warning", fixes=["mask-special-labels"])
