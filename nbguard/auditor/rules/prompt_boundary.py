"""Prompt-completion rows whose training sequence does not start with the whole tokenized prompt.

TRL's SFTTrainer tokenizes the prompt alone and the prompt followed by its completion. Where the first
is not a prefix of the second (a prompt ending in whitespace that merges into the completion's first
token, a chat template that renders the prompt alone differently), it starts the completion where they
diverge, and the prompt's end is in no training sequence. TRL says so once per process
(``warning_once``): a trainer built again in the same kernel says nothing. This rule reads the
trainer's own tokenized rows at every audit.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...explainer.warnings import MOVE_WHITESPACE, is_whitespace, prompt_cut_cause
from ..registry import capped, finding, rule

SAMPLED_ROWS = 64


@dataclass(frozen=True)
class CutRow:
    index: int
    dropped: str  # the tokenized prompt's end that is not in the row's input_ids
    masked: str  # the completion's first token(s), where the labels count them as prompt ("": none)


def _supervised_from(row: dict) -> int | None:
    """The first supervised position of a row (its labels, or TRL's completion_mask), None when it has neither."""
    labels, mask = row.get("labels"), row.get("completion_mask")
    if isinstance(labels, list):
        return next((i for i, label in enumerate(labels) if label != -100), None)
    if isinstance(mask, list):
        return next((i for i, m in enumerate(mask) if m), None)
    return None


def _cut_rows(tok, dataset) -> tuple[int, list[CutRow]]:
    """(rows checked, the cut ones) over the first rows with a text prompt."""
    checked, cut = 0, []
    for index in range(min(len(dataset), SAMPLED_ROWS)):
        row = dataset[index]
        prompt, ids = row.get("prompt"), row.get("input_ids")
        if not isinstance(prompt, str) or not isinstance(ids, list):
            continue  # a conversational prompt is rendered by the chat template: what TRL compared is not kept
        prompt_ids = tok(prompt)["input_ids"]  # as TRL tokenizes a text prompt (processing_class(text=prompt))
        shared = next((i for i, (a, b) in enumerate(zip(prompt_ids, ids)) if a != b), min(len(prompt_ids), len(ids)))
        if shared == len(ids) < len(prompt_ids):
            continue  # truncated to max_length inside the prompt: no completion left to compare with
        checked += 1
        if shared < len(prompt_ids):
            start = _supervised_from(row)
            masked = tok.decode(ids[shared:start]) if start is not None and start > shared else ""
            cut.append(CutRow(index, tok.decode(prompt_ids[shared:]), masked))
    return checked, cut


def _most_common(texts: list[str]) -> list[str]:
    """Distinct texts, most frequent first; ties in the order the rows gave them."""
    return sorted(dict.fromkeys(texts), key=lambda text: -texts.count(text))


@rule("prompt-end-not-trained", "warning")
def prompt_end_not_trained(ctx):
    """Prompt-completion rows whose tokenized input does not start with the whole tokenized prompt: the prompt's end is never trained (TRL), or the labels mask the completion's first token as prompt (masking by the prompt's own length)."""
    dataset = getattr(ctx.trainer, "train_dataset", None)
    columns = set(getattr(dataset, "column_names", None) or [])
    if ctx.tokenizer is None or not {"prompt", "completion", "input_ids"} <= columns:
        return None
    checked, cut = _cut_rows(ctx.tokenizer, dataset)
    if not cut:
        return None
    dropped = _most_common([row.dropped for row in cut])
    masked = _most_common([row.masked for row in cut if row.masked])
    evidence = {"rows_checked": checked, "rows_cut": capped([row.index for row in cut]),
                "dropped_texts": capped(dropped), "whitespace_only": is_whitespace(dropped[0]),
                "completion_start_masked": capped(masked),
                "rows_masking_completion_start": capped([row.index for row in cut if row.masked])}
    if masked:
        n = sum(1 for row in cut if row.masked)
        return finding(
            "prompt-end-not-trained",
            f"{n} of {checked} checked rows never supervise the start of their completion ({masked[0]!r})",
            f"Where the prompt alone ends in {dropped[0]!r}, the prompt+completion has {masked[0]!r}: the tokens at "
            "the boundary differ. The labels mask as many tokens as the prompt alone has, so "
            f"{masked[0]!r}, where the completion begins, counts as prompt: the model is never taught to produce "
            "it, and at inference it continues from a prompt end it never saw. "
            + (MOVE_WHITESPACE + " Or mask by the tokens the prompt and the prompt+completion share, not by the "
               "prompt's own length." if is_whitespace(dropped[0]) else
               "Mask by the tokens the prompt and the prompt+completion share, not by the prompt's own length, "
               "and end prompts on a token boundary."),
            evidence)
    _, cause = prompt_cut_cause(dropped[0])
    return finding(
        "prompt-end-not-trained",
        f"{len(cut)} of {checked} checked rows train without the end of their prompt ({dropped[0]!r})",
        cause, evidence)


def _excerpt(text: str, limit: int = 40) -> str:
    from ...document.outward import outward

    short = text if len(text) <= limit else text[:limit] + "…"
    return str(outward(short))


@rule("prompt-encodes-empty", "error")
def prompt_encodes_empty(ctx):
    """Rows whose non-empty prompt or text the tokenizer encodes to no tokens at all (e.g. a word-level tokenizer.json reloaded as another model's tokenizer class): nothing of the row reaches the model, and SFT logs loss 0 and grad norm 0 every step."""
    dataset = getattr(ctx.trainer, "train_dataset", None)
    columns = [c for c in ("prompt", "text") if c in set(getattr(dataset, "column_names", None) or [])]
    if ctx.tokenizer is None or not columns:
        return None
    checked, empty = 0, []
    for index in range(min(len(dataset), SAMPLED_ROWS)):
        row = dataset[index]
        text = next((row[c] for c in columns if isinstance(row.get(c), str) and row[c].strip()), None)
        if text is None:
            continue  # conversational or empty: rendered by the chat template, not compared here
        checked += 1
        ids = ctx.tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) == 0:
            empty.append((index, text))
    if not empty:
        return None
    return finding(
        "prompt-encodes-empty",
        f"the tokenizer encodes {len(empty)} of {checked} checked non-empty prompts to no tokens",
        f"{type(ctx.tokenizer).__name__} turns text such as {_excerpt(empty[0][1])!r} into an empty list of ids: "
        "the training rows hold only special tokens, so there is nothing to learn from (SFT logs loss 0 and grad "
        "norm 0 every step). Its vocabulary or pre-tokenizer does not match its class: a tokenizer.json saved "
        "beside another model's config reloads as that model's tokenizer class. Load the tokenizer the data was "
        "meant for (PreTrainedTokenizerFast(tokenizer_file=...) for a hand-built one) and check that "
        "tokenizer(prompt)['input_ids'] is not empty before building the trainer.",
        {"rows_checked": checked, "rows_empty": capped([i for i, _ in empty]),
         "excerpts": capped([_excerpt(t) for _, t in empty], 3), "tokenizer_class": type(ctx.tokenizer).__name__})
