"""Assistant-only loss as the chat template really masks it: the share of supervised tokens per role.

With ``assistant_only_loss=True`` TRL supervises exactly the tokens the chat template wraps in
``{% generation %}...{% endgeneration %}`` (``apply_chat_template(return_assistant_tokens_mask=True)``).
A template without the markers masks everything (nothing is learned), one whose block wraps the
whole conversation supervises the user's and the system's words, and Qwen3-style templates put an
empty ``<think></think>`` inside the block, teaching the model to skip its reasoning. The rule renders
a probe conversation with the template the trainer will use and counts the masked tokens per role.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..chat_render import PROBE  # one probe conversation for every template rule
from ..registry import finding, rule

_EMPTY_THINK = re.compile(r"<think>\s*</think>")
SAMPLED_CONVERSATIONS = 8


@dataclass
class RoleSupervision:
    """Supervised / total tokens per role of one rendered conversation ("all": the roles could not be told apart)."""

    supervised: dict[str, int] = field(default_factory=dict)
    total: dict[str, int] = field(default_factory=dict)
    empty_think_supervised: int = 0

    def share(self, role: str) -> float:
        return self.supervised.get(role, 0) / self.total[role] if self.total.get(role) else 0.0

    def to_evidence(self) -> dict:
        return {role: {"supervised": self.supervised.get(role, 0), "tokens": n, "share": round(self.share(role), 3)}
                for role, n in self.total.items()}


def training_template(ctx) -> str | None:
    """The chat template training renders with: TRL's swapped-in training template, else the tokenizer's own."""
    template = getattr(ctx.trainer, "chat_template", None) or getattr(ctx.tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named variants: the default one is what apply_chat_template uses
        template = template.get("default")
    return template if isinstance(template, str) else None


def _message_spans(tok, template: str, messages: list[dict], text: str) -> list[tuple[int, int, str]]:
    """(start, end, role) character spans, from renders of each prefix (the first span holds the template's
    opening, a BOS for one); empty when the template is not prefix-preserving."""
    spans, start = [], 0
    for k in range(1, len(messages) + 1):
        prefix = tok.apply_chat_template(messages[:k], chat_template=template, tokenize=False)
        if not text.startswith(prefix):
            return []
        spans.append((start, len(prefix), messages[k - 1]["role"]))
        start = len(prefix)
    return spans


def _count(out: RoleSupervision, tok, template: str, messages: list[dict], supervised: list[bool]) -> bool:
    """Add one conversation's tokens to ``out`` by role; False when its ids are not the template's rendering."""
    text = tok.apply_chat_template(messages, chat_template=template, tokenize=False)
    offsets = tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    if len(offsets) < len(supervised):
        return False
    spans = _message_spans(tok, template, messages, text)
    thinks = [m.span() for m in _EMPTY_THINK.finditer(text)]
    for (begin, _), masked in zip(offsets, supervised):
        role = next((r for s, e, r in spans if s <= begin < e), "all")
        out.total[role] = out.total.get(role, 0) + 1
        out.supervised[role] = out.supervised.get(role, 0) + int(masked)
        if masked and any(s <= begin < e for s, e in thinks):
            out.empty_think_supervised += 1
    return True


def role_supervision(tok, template: str, messages: list[dict] = PROBE) -> RoleSupervision:
    """Render ``messages`` with the assistant mask and count supervised tokens per role."""
    rendered = tok.apply_chat_template(messages, chat_template=template, tokenize=True, return_dict=True,
                                       return_assistant_tokens_mask=True)
    out = RoleSupervision()
    if not _count(out, tok, template, messages, [bool(m) for m in rendered["assistant_masks"]]):
        raise RuntimeError("the rendered conversation tokenises to fewer tokens than its assistant mask")
    return out


def sampled_role_supervision(ctx, template: str) -> tuple[RoleSupervision, int] | None:
    """The same count on the trainer's own examples (TRL keeps "messages" beside input_ids and labels):
    supervised = labels != -100. None when the dataset keeps no conversations or labels."""
    dataset = getattr(ctx.trainer, "train_dataset", None)
    columns = getattr(dataset, "column_names", None) or []
    if dataset is None or not {"messages", "input_ids", "labels"} <= set(columns):
        return None
    out, rows = RoleSupervision(), 0
    for index in range(min(len(dataset), SAMPLED_CONVERSATIONS)):
        example = dataset[index]
        ids = list(example["input_ids"])
        rendered = ctx.tokenizer(ctx.tokenizer.apply_chat_template(example["messages"], chat_template=template,
                                                                   tokenize=False), add_special_tokens=False)
        if rendered["input_ids"][:len(ids)] != ids:  # built some other way (tools, extra kwargs): not comparable
            continue
        rows += _count(out, ctx.tokenizer, template, example["messages"], [v != -100 for v in example["labels"]])
    return (out, rows) if rows else None


@rule("assistant-loss-coverage", "error")
def assistant_loss_coverage(ctx):
    """assistant_only_loss with a chat template that masks nothing, or supervises other roles or an empty <think></think>."""
    if not getattr(ctx.args, "assistant_only_loss", False) or ctx.tokenizer is None:
        return None
    template = training_template(ctx)
    if template is None:
        return None
    probe = role_supervision(ctx.tokenizer, template)
    sampled = sampled_role_supervision(ctx, template)
    # The trainer's own rows when they can be read back, else the probe conversation.
    seen = sampled[0] if sampled else probe
    others = {r: seen.supervised.get(r, 0) for r in seen.total if r not in ("assistant", "all")}
    evidence = {"per_role": seen.to_evidence(), "per_role_source": "sampled rows" if sampled else "probe conversation",
                "probe_per_role": probe.to_evidence(), "sampled_rows": sampled[1] if sampled else 0,
                "empty_think_supervised": seen.empty_think_supervised,
                "generation_markers": bool(re.search(r"\{%-?\s*generation\s*-?%\}", template))}
    if sum(seen.supervised.values()) == 0:
        return finding(
            "assistant-loss-coverage", "assistant_only_loss supervises nothing: the chat template has no assistant mask",
            "Rendered with return_assistant_tokens_mask=True, no token of a probe conversation is in the assistant "
            "mask: the template has no {% generation %}...{% endgeneration %} block around the assistant's reply "
            "(transformers warns \"chat template does not contain `{% generation %}` keyword\"; TRL raises \"at least "
            "one example has no assistant tokens\" or \"the chat template is not training-compatible\"). Every label "
            "is -100: the loss is NaN or zero and nothing is learned. Wrap each assistant reply (and its end-of-turn "
            "token) in {% generation %}...{% endgeneration %}, or use trl.chat_template_utils.get_training_chat_template.",
            evidence)
    if any(others.values()) or seen.empty_think_supervised:
        what = [f"{n} {r} token(s)" for r, n in others.items() if n]
        if seen.empty_think_supervised:
            what.append(f"{seen.empty_think_supervised} token(s) of an empty <think></think> block")
        return finding(
            "assistant-loss-coverage", f"assistant_only_loss also supervises {', '.join(what)}",
            "The {% generation %} block of the chat template covers more than the assistant's reply: the model is "
            "trained to write the user's and the system's turns, or (an empty <think></think> inside the block, as "
            "Qwen3's template renders for turns without reasoning) to answer without thinking. Move the block so it "
            "wraps only the assistant's content and its end-of-turn token.",
            evidence, severity="warning")
    return None
