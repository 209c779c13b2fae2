"""Multi-turn RL whose chat template re-renders earlier turns otherwise once a new turn follows.

A multi-turn or tool-calling rollout samples a turn, appends it, and renders the conversation again
for the next turn; the trainer then scores the sampled ids under the re-rendered context. That needs
each rendering to be a prefix of the next. Qwen3-style templates drop the ``<think>`` block of every
assistant turn before the last user message (trl#5224, verl#6719): the reasoning the model sampled is
gone from the context it is trained on. TRL's own check (``is_chat_template_prefix_preserving``) probes
a tool call without reasoning and passes such templates. This rule renders a probe conversation whose
assistant turns reason, turn by turn, and compares each rendering with the next.
"""
from __future__ import annotations

from typing import Any

from ...introspect.trl import GENERATING, trl_stack
from ..chat_render import first_mismatch, render_ids
from ..registry import finding, rule
from .serving_template import served_template

REASONING_PROBE = [
    {"role": "user", "content": "What is two plus three?"},
    {"role": "assistant", "content": "<think>\nTwo and three make five.\n</think>\n\nFive."},
    {"role": "user", "content": "And times four?"},
    {"role": "assistant", "content": "<think>\nFive times four is twenty.\n</think>\n\nTwenty."},
]


def turn_by_turn(tok: Any, template: str, messages: list[dict] = REASONING_PROBE) -> list[dict]:
    """Each rendering of messages[:k] (with the generation prompt where the next turn is the model's) against
    the rendering of messages[:k+1]: one entry per step where the earlier one is not a prefix of the later."""
    renders = [render_ids(tok, template, messages[:k], generation_prompt=messages[k - 1]["role"] != "assistant")
               for k in range(1, len(messages) + 1)]
    out = []
    for k in range(1, len(renders)):
        found = first_mismatch(tok, renders[k], renders[k - 1], prefix=True)
        if found is not None:
            out.append({"turns": k, "next_turn_role": messages[k]["role"], "position": found["position"],
                        "earlier_rendering": found["served"], "later_rendering": found["trained"],
                        "before": found["before"]})
    return out


def trl_says_prefix_preserving(tok: Any) -> bool | None:
    """TRL's own verdict where installed (its probe is a tool call without reasoning), else None."""
    try:
        from trl.chat_template_utils import is_chat_template_prefix_preserving
    except ImportError:
        return None
    try:
        return bool(is_chat_template_prefix_preserving(tok))
    except Exception:  # noqa: BLE001  (a template without tool support may raise on TRL's probe)
        return None


def _multi_turn(trainer: Any) -> bool:
    """Rollouts that re-render a conversation: tools to call, or prompts that already hold an assistant turn."""
    if getattr(trainer, "tools", None):
        return True
    dataset = getattr(trainer, "train_dataset", None)
    try:
        prompt = dataset[0].get("prompt") if dataset is not None and len(dataset) else None
    except (TypeError, KeyError, IndexError, AttributeError):
        return False
    return isinstance(prompt, list) and any(isinstance(m, dict) and m.get("role") == "assistant" for m in prompt)


@rule("multi-turn-render-not-prefix", "warning")
def multi_turn_render_not_prefix(ctx):
    """A multi-turn or tool-calling RL trainer whose chat template, rendering a conversation with reasoning turn by turn, does not keep each rendering a prefix of the next (earlier <think> blocks dropped): the sampled tokens are trained under another context than they were sampled in."""
    tok = ctx.tokenizer
    if tok is None or trl_stack(ctx.trainer) not in GENERATING or not _multi_turn(ctx.trainer):
        return None
    template = served_template(ctx)  # the tokenizer's own template: what rollouts render with
    if template is None:
        return None
    try:
        broken = turn_by_turn(tok, template)
    except Exception:  # noqa: BLE001  (a template that rejects the probe: nothing to compare)
        return None
    if not broken:
        return None
    first = broken[0]
    trl_verdict = trl_says_prefix_preserving(tok)
    trl_note = (" TRL's own check (is_chat_template_prefix_preserving) returns True for this template: its probe "
                "has no reasoning." if trl_verdict else "")
    return finding(
        "multi-turn-render-not-prefix",
        f"rendering the next turn changes token {first['position']} of the conversation so far",
        f"A probe conversation whose assistant turns reason (<think>...</think>), rendered after {first['turns']} "
        f"message(s) and again once a {first['next_turn_role']} message follows, differs at token "
        f"{first['position']}: {first['earlier_rendering']!r} became {first['later_rendering']!r} (after "
        f"{' '.join(map(str, first['before']))!r}). In a multi-turn rollout the model sampled the first rendering's "
        "tokens and the trainer scores them under the second: earlier reasoning is dropped from the context, so "
        "log-probabilities and the importance ratio are computed on another sequence than the one sampled."
        f"{trl_note} Use a template that keeps earlier turns as rendered (for Qwen3, one that keeps every "
        "<think> block), or build each turn's context from the sampled ids instead of re-rendering.",
        {"breaks": broken[:5], "trl_prefix_check": trl_verdict, "template_chars": len(template)})
