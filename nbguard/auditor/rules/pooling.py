"""Sequence-classification / reward models that pool a different token than the sequence's last.

A decoder's ``*ForSequenceClassification`` head scores the rightmost token that is not
``config.pad_token_id``. With no pad id it cannot batch at all ("Cannot handle batch sizes > 1 if no
padding token is defined"); with a pad id equal to EOS (or different from the one the tokenizer pads
with) it pools the token before the final EOS, or a padding token, instead of the last real one:
the reward is read off the wrong position (trl#937, transformers#35352).
"""
from __future__ import annotations

import torch

from ...introspect.tokenizers import tokenizer_of
from ..registry import capped, finding, rule


def _is_decoder_classifier(model) -> bool:
    """A decoder's classification head (``score``, pooling the last token), under PEFT or not."""
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    return hasattr(base, "score") and any(c.__name__.endswith("ForSequenceClassification") for c in type(base).__mro__)


def pooled_positions(input_ids: torch.Tensor, pad_id: int) -> torch.Tensor:
    """The position transformers' classification head pools: the rightmost token that is not ``pad_id``."""
    non_pad = (input_ids != pad_id).int()
    return (torch.arange(input_ids.shape[1], device=input_ids.device) * non_pad).argmax(dim=-1)


def last_attended(mask: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(mask.shape[1], device=mask.device)
    return (positions * mask.long()).argmax(dim=-1)


def pad_id_in_training(ctx) -> tuple[int | None, bool]:
    """The pad id the head will pool with in train(), and whether the Trainer set it: transformers 5's Trainer
    copies its processing_class's special tokens into the model config before training (align_special_tokens)."""
    import transformers.trainer_utils as trainer_utils

    pad = getattr(ctx.text_config, "pad_token_id", None)
    tok_pad = getattr(tokenizer_of(ctx.trainer), "pad_token_id", None)
    if tok_pad is not None and hasattr(trainer_utils, "align_special_tokens"):
        return tok_pad, tok_pad != pad
    return pad, False


@rule("classifier-pools-wrong-token", "error")
def classifier_pools_wrong_token(ctx):
    """A decoder classification / reward head with no pad_token_id, or one that pools another token than the last real one."""
    if ctx.model is None or not _is_decoder_classifier(ctx.model):
        return None
    pad, aligned = pad_id_in_training(ctx)
    batch_size = max([int(b["input_ids"].shape[0]) for b in ctx.batches if isinstance(b.get("input_ids"), torch.Tensor)]
                     + [int(getattr(ctx.args, "per_device_train_batch_size", 1) or 1)])
    tok_pad = getattr(ctx.tokenizer, "pad_token_id", None)
    if pad is None:
        if batch_size < 2:
            return None
        return finding(
            "classifier-pools-wrong-token", "the classification head has no pad_token_id: batches above 1 row fail",
            "model.config.pad_token_id is None, so the head cannot find each row's last token and raises \"Cannot "
            f"handle batch sizes > 1 if no padding token is defined\" (batch size {batch_size}). Set "
            "model.config.pad_token_id to the tokenizer's pad id (a pad token distinct from EOS).",
            {"pad_token_id_in_training": None, "tokenizer_pad_token_id": tok_pad, "batch_size": batch_size},
            fixes=["sync-pad-token-id"])
    wrong, rows, padded_with = [], 0, set()
    for b, batch in enumerate(ctx.batches):
        ids, mask = batch.get("input_ids"), batch.get("attention_mask")
        if not isinstance(ids, torch.Tensor) or not isinstance(mask, torch.Tensor) or mask.shape != ids.shape:
            continue
        rows += ids.shape[0]
        padded_with |= set(ids[mask == 0].tolist())  # what the trainer's own collator pads with
        off = (pooled_positions(ids, pad) != last_attended(mask)) & mask.bool().any(dim=1)
        wrong += [[b, r] for r in off.nonzero().flatten().tolist()]
    if not wrong:
        return None
    eos = getattr(ctx.tokenizer, "eos_token_id", None) or getattr(ctx.text_config, "eos_token_id", None)
    # pad == EOS in the config, or batches padded with another id than the config's: the pad token must change
    # where the batches are made (tokenizer, config and the collator built with them)
    padding_wrong = pad == eos or bool(padded_with - {pad})
    return finding(
        "classifier-pools-wrong-token", f"{len(wrong)} of {rows} sampled rows are scored at the wrong token",
        f"The head pools the rightmost token that is not pad_token_id={pad}, but in these rows that is not the last "
        "token the attention mask keeps"
        + (": pad_token_id is the EOS id, so a final EOS counts as padding and the score is read one token early. "
           if pad == eos else f" (the batches are padded with id {', '.join(map(str, sorted(padded_with)))}). ")
        + "The reward / class is learned from the wrong position. Give the tokenizer a pad token distinct from EOS "
          "and set model.config.pad_token_id to it.",
        {"pad_token_id_in_training": pad, "set_by_trainer_from_tokenizer": aligned, "tokenizer_pad_token_id": tok_pad,
         "eos_token_id": eos, "batches_padded_with": sorted(padded_with), "rows": capped(wrong),
         **ctx.sample.to_evidence()},
        fixes=["distinct-pad-token"] if padding_wrong else ["sync-pad-token-id"])
