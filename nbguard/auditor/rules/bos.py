"""Double BOS: the chat template writes the BOS token and the tokenizer adds its own when the text is encoded."""
from __future__ import annotations

import torch

from ...fixes.setup_fixes import bos_switchable
from ..registry import capped, finding, rule
from .chat_loss import PROBE, training_template


def _leading_pairs(batch: dict, bos: int) -> torch.Tensor | None:
    """(rows,) True where the first two attended tokens are both BOS (left padding skipped)."""
    ids, mask = batch.get("input_ids"), batch.get("attention_mask")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[1] < 2:
        return None
    if not isinstance(mask, torch.Tensor) or mask.shape != ids.shape:
        mask = torch.ones_like(ids)
    first = mask.long().argmax(dim=1)  # the first attended position of each row
    second = (first + 1).clamp(max=ids.shape[1] - 1)
    rows = torch.arange(ids.shape[0], device=ids.device)
    return (ids[rows, first] == bos) & (ids[rows, second] == bos) & (second > first)


def template_then_encode_doubles(tok, template: str | None) -> bool:
    """Whether rendering the template to text and encoding it (add_special_tokens=True) starts with two BOS."""
    if template is None:
        return False
    text = tok.apply_chat_template(PROBE, chat_template=template, tokenize=False)
    ids = tok(text)["input_ids"]
    return len(ids) >= 2 and ids[0] == ids[1] == tok.bos_token_id


@rule("double-bos", "warning")
def double_bos(ctx):
    """Rows that start with two BOS tokens: the chat template rendered one and the tokenizer added another."""
    tok = ctx.tokenizer
    bos = getattr(tok, "bos_token_id", None) if tok is not None else None
    if bos is None:
        bos = next((c.bos_token_id for c in ctx.configs if isinstance(getattr(c, "bos_token_id", None), int)), None)
    if bos is None:
        return None
    per_batch = [p for p in (_leading_pairs(b, bos) for b in ctx.batches) if p is not None]
    doubled = sum(int(p.sum()) for p in per_batch)
    if not doubled:
        return None
    rows = sum(int(p.numel()) for p in per_batch)
    cause = tok is not None and template_then_encode_doubles(tok, training_template(ctx))
    return finding(
        "double-bos", f"{doubled} of {rows} sampled rows start with two BOS tokens",
        ("The chat template writes the BOS token into the text and the tokenizer adds its own when that text is "
         "encoded (apply_chat_template(tokenize=False), then tokenizer(text)). " if cause else
         "The text already held a BOS token when the tokenizer added its own. ")
        + "The model was pre-trained with one BOS: every example now starts out of distribution, and at inference "
          "(one BOS) the fine-tuned model sees a different prefix than it trained on. Drop the second BOS from the "
          "rows already tokenized, and for new data strip the BOS from the text before it is tokenized (or pass the "
          "messages and let the trainer apply the template). TRL's SFTTrainer tokenizes a text field with the "
          "tokenizer's special tokens whatever dataset_kwargs says.",
        {"bos_token_id": bos, "rows": capped([[b, r] for b, p in enumerate(per_batch) for r in p.nonzero().flatten().tolist()]),
         "template_renders_bos_and_tokenizer_adds_one": cause, **ctx.sample.to_evidence()},
        fixes=(["drop-doubled-bos"] if ctx.trainer is not None else [])
        + (["tokenizer-no-bos"] if tok is not None and bos_switchable(tok) else []))
