"""Token-level comparisons of chat renderings: the prompt a model is served against the one it was trained on.

A model fine-tuned on chat rows learns each assistant turn after the exact tokens training put before it.
At serving time the prompt is ``apply_chat_template(messages[:k], add_generation_prompt=True)``: if that
is not a prefix of the training rendering, the model answers after tokens it never saw before an answer
(Qwen3's generation prompt adds ``<think>\\n\\n</think>`` that past turns never show; a training template
TRL swapped in renders the turn differently from the tokenizer's own template that is saved and served).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

PROBE = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is two plus three?"},
    {"role": "assistant", "content": "Two plus three is five."},
    {"role": "user", "content": "And times four?"},
    {"role": "assistant", "content": "Five times four is twenty."},
]
CONTEXT = 4


def render_ids(tok: Any, template: str, messages: list[dict], generation_prompt: bool = False) -> list[int]:
    out = tok.apply_chat_template(messages, chat_template=template, tokenize=True,
                                  add_generation_prompt=generation_prompt)
    if isinstance(out, Mapping):  # transformers 5 returns a BatchEncoding
        out = out["input_ids"]
    return [int(i) for i in out]


def _token(tok: Any, ids: list[int], i: int) -> str | None:
    return tok.convert_ids_to_tokens(ids[i]) if i < len(ids) else None


def first_mismatch(tok: Any, reference: list[int], other: list[int], *, prefix: bool = False) -> dict | None:
    """Where ``other`` first departs from ``reference`` (``prefix=True``: ``other`` only has to be a prefix
    of it), with the tokens on each side and the tokens just before; None when it does not."""
    n = len(other) if prefix else max(len(reference), len(other))
    for i in range(n):
        if i >= len(reference) or i >= len(other) or reference[i] != other[i]:
            return {"position": i, "trained": _token(tok, reference, i), "served": _token(tok, other, i),
                    "before": tok.convert_ids_to_tokens(reference[max(0, i - CONTEXT):i])}
    return None


def first_difference(train_tok: Any, train_template: str, served_tok: Any, served_template: str,
                     messages: list[dict] = PROBE) -> dict | None:
    """The first token where a probe conversation renders differently with the saved template."""
    return first_mismatch(train_tok, render_ids(train_tok, train_template, messages),
                          render_ids(served_tok, served_template, messages))


def serving_mismatches(tok: Any, serving_template: str, messages: list[dict], trained_ids: list[int]) -> list[dict]:
    """For each assistant turn k: is ``apply_chat_template(messages[:k], add_generation_prompt=True)`` a prefix
    of the ids the model was trained on? One entry per turn where it is not, naming the first differing token."""
    out = []
    for k, message in enumerate(messages):
        if message.get("role") != "assistant" or k == 0:
            continue
        prompt = render_ids(tok, serving_template, messages[:k], generation_prompt=True)
        found = first_mismatch(tok, trained_ids, prompt, prefix=True)
        if found is not None:
            out.append({"turn": k, **found})
    return out
