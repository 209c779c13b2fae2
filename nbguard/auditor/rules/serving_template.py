"""The template you will serve: the generation prompt against the prefix each assistant turn was trained after.

At serving time a chat model answers after ``apply_chat_template(messages[:k], add_generation_prompt=True)``.
Training showed it each assistant turn after the tokens its rendering put there. When the two differ (a
generation prompt that adds ``<think>\\n\\n</think>`` past turns never show, a training template TRL swapped in
that renders turns otherwise, a dataset tokenized with another template), the served model starts its answers
from a context it never learned from. The rule reads the trainer's own chat rows.
"""
from __future__ import annotations

from ..chat_render import render_ids, serving_mismatches
from ..registry import finding, rule
from .chat_loss import training_template

SAMPLED_CONVERSATIONS = 8


def served_template(ctx) -> str | None:
    """The tokenizer's own template: what save_pretrained writes and a server renders with (the multi-turn
    rule reads it too: rollouts render with it)."""
    template = getattr(ctx.tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    return template if isinstance(template, str) else None


@rule("chat-template-serving-mismatch", "warning")
def chat_template_serving_mismatch(ctx):
    """A chat dataset whose assistant turns were trained after other tokens than the served generation prompt renders."""
    dataset = getattr(ctx.trainer, "train_dataset", None)
    columns = getattr(dataset, "column_names", None) or []
    if dataset is None or "messages" not in columns or ctx.tokenizer is None:
        return None
    served = served_template(ctx)
    trained_with = training_template(ctx)
    if served is None or trained_with is None:
        return None
    seen: list[dict] = []
    rows = 0
    for index in range(min(len(dataset), SAMPLED_CONVERSATIONS)):
        example = dataset[index]
        messages = example["messages"]
        if not isinstance(messages, list) or not any(m.get("role") == "assistant" for m in messages):
            continue
        ids = list(example["input_ids"]) if "input_ids" in columns else render_ids(ctx.tokenizer, trained_with, messages)
        rows += 1
        seen += [{"row": index, **m} for m in serving_mismatches(ctx.tokenizer, served, messages, ids)]
    if not seen:
        return None
    first = seen[0]
    return finding(
        "chat-template-serving-mismatch",
        f"served prompts differ from training at token {first['position']}: {first['served']!r} where training had "
        f"{first['trained']!r}",
        f"Row {first['row']}, assistant turn {first['turn']}: apply_chat_template(messages[:{first['turn']}], "
        f"add_generation_prompt=True) gives {first['served']!r} after {' '.join(map(str, first['before']))!r}, where "
        f"the training ids have {first['trained']!r}. The model learns each reply after the training rendering and is "
        "served after the generation prompt: make the template's generation prompt render exactly what precedes an "
        "assistant turn (and train with the template you save and serve).",
        {"mismatches": seen[:10], "turns_mismatched": len(seen), "rows_checked": rows,
         "same_template": served == trained_with})
