"""Prompt-completion rows whose training sequence does not start with the whole tokenized prompt.

TRL's SFTTrainer tokenizes the prompt alone and the prompt followed by its completion. Where the first
is not a prefix of the second (a prompt ending in whitespace that merges into the completion's first
token, a chat template that renders the prompt alone differently), it starts the completion where they
diverge, and the prompt's end is in no training sequence. TRL says so once per process
(``warning_once``): a trainer built again in the same kernel says nothing. This rule reads the
trainer's own tokenized rows at every audit.
"""
from __future__ import annotations

from ...explainer.warnings import prompt_cut_cause
from ..registry import capped, finding, rule

SAMPLED_ROWS = 64


def _cut_rows(tok, dataset) -> tuple[int, list[tuple[int, str]]]:
    """(rows checked, [(row, the prompt's end missing from its input_ids)]) over the first rows with a text prompt."""
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
            cut.append((index, tok.decode(prompt_ids[shared:])))
    return checked, cut


@rule("prompt-end-not-trained", "warning")
def prompt_end_not_trained(ctx):
    """Prompt-completion rows whose tokenized input starts without the end of the tokenized prompt: TRL trained them on a context the model does not see at inference."""
    dataset = getattr(ctx.trainer, "train_dataset", None)
    columns = set(getattr(dataset, "column_names", None) or [])
    if ctx.tokenizer is None or not {"prompt", "completion", "input_ids"} <= columns:
        return None
    checked, cut = _cut_rows(ctx.tokenizer, dataset)
    if not cut:
        return None
    dropped = sorted({text for _, text in cut}, key=lambda text: -sum(t == text for _, t in cut))
    whitespace, cause = prompt_cut_cause(dropped[0])
    return finding(
        "prompt-end-not-trained",
        f"{len(cut)} of {checked} checked rows train without the end of their prompt ({dropped[0]!r})",
        cause, {"rows_checked": checked, "rows_cut": capped([index for index, _ in cut]),
                "dropped_texts": capped(dropped), "whitespace_only": whitespace})
