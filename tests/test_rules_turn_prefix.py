"""Issue 43 item 4: multi-turn RL whose chat template drops earlier <think> blocks once a new user turn follows
(Qwen3's behaviour, written here as a small template of our own). A real GRPOTrainer on multi-turn conversational
prompts: the rule renders a reasoning probe turn by turn and names where a rendering stops being a prefix of the
next, while TRL's own prefix check (no reasoning in its probe) passes the template; a template that keeps every turn
as rendered stays quiet."""
from __future__ import annotations

import pytest
from chat_helpers import WITHOUT_GENERATION, chat_tokenizer

import nbguard
from nbguard.testing import tiny_qwen2

pytest.importorskip("trl")

RULE = "multi-turn-render-not-prefix"
# Assistant turns before the last user message lose their reasoning: content after </think> only.
DROPS_EARLIER_THINK = (
    "{{ bos_token }} {%- set ns = namespace(last_user=0) -%}{%- for m in messages -%}{%- if m['role'] == 'user' -%}"
    "{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'assistant' -%}{%- set c = m['content'] -%}"
    "{%- if loop.index0 < ns.last_user and '</think>' in c -%}{%- set c = c.split('</think>')[-1] -%}{%- endif -%}"
    "<|assistant|> {{ c }} </s> {% else %}<|{{ m['role'] }}|> {{ m['content'] }} </s> {% endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt %}<|assistant|> {% endif -%}")


def multi_turn_prompts(rows: int = 8) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": f"w{10 + i} w11"},
                        {"role": "assistant", "content": f"<think> w20 w{30 + i} </think> w40"},
                        {"role": "user", "content": "w12 w13"}]} for i in range(rows)]


def word_count(completions, **kwargs):
    return [float(len(c[0]["content"].split())) for c in completions]


def grpo(tmp_path, template: str, prompts: list[dict]):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=str(tmp_path / "grpo"), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=8, max_steps=1, report_to="none", use_cpu=True, save_strategy="no",
                      disable_tqdm=True)
    return GRPOTrainer(model=tiny_qwen2(), reward_funcs=word_count, args=args,
                       train_dataset=Dataset.from_list(prompts), processing_class=chat_tokenizer(template))


def findings(trainer) -> list:
    return [f for f in nbguard.audit(trainer=trainer).findings if f.rule == RULE]


def test_a_template_that_drops_earlier_reasoning_is_named_though_trls_check_passes_it(tmp_path):
    from trl.chat_template_utils import is_chat_template_prefix_preserving

    trainer = grpo(tmp_path, DROPS_EARLIER_THINK, multi_turn_prompts())
    assert is_chat_template_prefix_preserving(trainer.processing_class)  # the gap: TRL's probe has no reasoning
    (f,) = findings(trainer)
    assert f.severity.value == "warning" and f.evidence["trl_prefix_check"] is True
    (first, *_) = f.evidence["breaks"]
    assert first["turns"] == 2 and first["next_turn_role"] == "user" and first["earlier_rendering"] == "<think>"
    assert "<think>" in f.detail and "is_chat_template_prefix_preserving" in f.detail


def test_a_template_that_keeps_every_turn_stays_quiet(tmp_path):
    assert findings(grpo(tmp_path, WITHOUT_GENERATION, multi_turn_prompts())) == []


def test_single_turn_prompts_are_not_re_rendered_and_stay_quiet(tmp_path):
    single = [{"prompt": [{"role": "user", "content": f"w{10 + i} w11"}]} for i in range(8)]
    assert findings(grpo(tmp_path, DROPS_EARLIER_THINK, single)) == []
