"""Issue 20: the TRL reward-count signature on TRL's own exception, and the add-warmup / finite-rewards fixes."""
from __future__ import annotations

import math

import pytest
from rl_helpers import grpo_trainer, length_reward, log_match_reward

import nbguard
from nbguard import fixes
from nbguard.explainer import diagnose


def one_score(completions, **kwargs):
    return [1.0]


def per_prompt(prompts, completions, **kwargs):  # one score per distinct prompt, not per completion
    return [1.0 for _ in dict.fromkeys(prompts)]


@pytest.mark.parametrize("func, returned, hint", [(one_score, 1, "a single value"), (per_prompt, 2, "8 is 4 x 2")])
def test_reward_count_signature_on_trls_own_error(tmp_path, func, returned, hint):
    trainer = grpo_trainer(tmp_path, reward_funcs=func, max_steps=1, per_device_train_batch_size=8)
    with pytest.raises(ValueError) as raised:
        trainer.train()
    diagnosis = diagnose(raised.value)
    assert diagnosis is not None and diagnosis.signature == "trl-reward-count-mismatch"
    assert diagnosis.evidence["reward_function"] == func.__name__ and diagnosis.evidence["expected"] == 8
    assert diagnosis.evidence["returned"] == returned and hint in diagnosis.detail


def test_reward_count_signature_reads_the_pasted_message():
    pasted = ("ValueError: The reward function `score`\nreturned 2 rewards, but 8 were expected (one per "
              "prompt-completion pair).")
    diagnosis = diagnose(ValueError(pasted))
    assert diagnosis.signature == "trl-reward-count-mismatch" and diagnosis.evidence["returned"] == 2
    assert "4 x 2" in diagnosis.detail
    assert diagnose(ValueError("The reward function returned a string")) is None


def test_add_warmup_takes_effect_at_the_next_train(tmp_path):
    trainer = grpo_trainer(tmp_path, max_steps=2)
    result = fixes.apply("add-warmup", trainer=trainer)
    assert result.changed == {"args.warmup_steps": "0 -> 0.1"}
    assert fixes.apply("add-warmup", trainer=trainer).changed == {}  # idempotent
    trainer.train()
    assert trainer.args.get_warmup_steps(2) == 1 and trainer.state.log_history[0]["learning_rate"] < 1e-3
    exec(fixes.code("add-warmup", trainer="t"), {"t": grpo_trainer(tmp_path)})
    with pytest.raises(ValueError, match="ratio must be"):
        fixes.apply("add-warmup", trainer=trainer, ratio=2)


def test_finite_rewards_restores_a_learning_signal(tmp_path):
    trainer = grpo_trainer(tmp_path, reward_funcs=[length_reward, log_match_reward])
    result = fixes.apply("finite-rewards", trainer=trainer, floor=-1.0)
    assert list(result.changed) == ["reward_funcs[0]", "reward_funcs[1]"]
    assert fixes.apply("finite-rewards", trainer=trainer, floor=-1.0).changed == {}
    assert trainer.reward_funcs[1](completions=["w3 w4", "w5 w5"]) == [-1.0, math.log(2)]
    trainer.train()
    assert all(math.isfinite(h["reward"]) for h in trainer.state.log_history if "reward" in h)
    cell = fixes.code("finite-rewards", trainer="t", floor=-1.0)
    kept = grpo_trainer(tmp_path, reward_funcs=[log_match_reward])
    exec(cell, {"t": kept})
    assert kept.reward_funcs[0](completions=["w3"]) == [-1.0]


def test_finite_rewards_needs_a_reward_trainer(tmp_path):
    from audit_helpers import make_args, make_trainer

    from nbguard.testing import tiny_llama

    with pytest.raises(ValueError, match="needs a TRL trainer with reward functions"):
        fixes.apply("finite-rewards", trainer=make_trainer(tiny_llama(), make_args(tmp_path)))
    assert nbguard.fixes.get("finite-rewards").needs == "trainer"
