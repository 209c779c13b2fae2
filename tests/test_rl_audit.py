"""Issue 20 item 3: audit rules for TRL's RL and preference configs, on real GRPO/DPO/KTO trainers."""
from __future__ import annotations

import pytest
from rl_helpers import dpo_trainer, grpo_trainer, kto_trainer, length_reward, log_match_reward, prompt_rows

import nbguard

RL_RULES = ("rl-few-generations", "rl-constant-loss-settings", "rl-completion-cap-short", "rl-reward-function-broken")


def rl_findings(trainer) -> dict[str, list]:
    out: dict[str, list] = {}
    for f in nbguard.audit(trainer=trainer).findings:
        if f.rule in RL_RULES:
            out.setdefault(f.rule, []).append(f)
    return out


def test_healthy_grpo_config_raises_no_rl_rule(tmp_path):
    assert rl_findings(grpo_trainer(tmp_path)) == {}


def test_two_generations_per_prompt_is_too_few_for_a_group_baseline(tmp_path):
    found = rl_findings(grpo_trainer(tmp_path, num_generations=2))
    assert [f.evidence["num_generations"] for f in found.pop("rl-few-generations")] == [2]
    assert found == {}


def test_greedy_sampling_makes_every_group_flat(tmp_path):
    (f,) = rl_findings(grpo_trainer(tmp_path, top_k=1))["rl-constant-loss-settings"]
    assert f.evidence["top_k"] == 1 and "identical" in f.detail


@pytest.mark.parametrize("make", [dpo_trainer, kto_trainer], ids=["dpo", "kto"])
def test_beta_zero_makes_the_preference_loss_constant(tmp_path, make):
    assert "rl-constant-loss-settings" in rl_findings(make(tmp_path, beta=0.0))
    assert rl_findings(make(tmp_path)) == {}


def test_completion_cap_shorter_than_the_answers(tmp_path):
    from datasets import Dataset

    long_answers = [{**r, "solution": " ".join(["w9"] * 20)} for r in prompt_rows()]
    trainer = grpo_trainer(tmp_path)
    trainer.train_dataset = Dataset.from_list(long_answers)
    (f,) = rl_findings(trainer)["rl-completion-cap-short"]
    assert f.evidence["answer_column"] == "solution" and f.evidence["median"] == 21 > 8
    trainer.train_dataset = Dataset.from_list([{**r, "solution": "w9 w9"} for r in prompt_rows()])
    assert "rl-completion-cap-short" not in rl_findings(trainer)


def test_reward_functions_run_once_on_real_completions(tmp_path):
    def wrong_length(completions, **kwargs):
        return [1.0]

    def needs_a_column(completions, answer, **kwargs):  # the dataset has no "answer" column
        return [float(a in c) for a, c in zip(answer, completions)]

    trainer = grpo_trainer(tmp_path, reward_funcs=[length_reward, wrong_length, needs_a_column, log_match_reward])
    found = {f.evidence["reward_function"]: f for f in rl_findings(trainer)["rl-reward-function-broken"]}
    assert set(found) == {"wrong_length", "needs_a_column", "log_match_reward"}
    assert found["wrong_length"].evidence["returned"] == 1 and found["wrong_length"].evidence["completions"] == 4
    assert found["needs_a_column"].evidence["exception"].startswith("TypeError") \
        and "'answer'" in found["needs_a_column"].evidence["exception"]
    nonfinite = found["log_match_reward"]
    assert nonfinite.severity.value == "warning" and float("-inf") in nonfinite.evidence["values"]
    assert nonfinite.fixes == ["finite-rewards"]


def test_the_reward_check_leaves_the_run_as_it_was(tmp_path):
    import torch

    trainer = grpo_trainer(tmp_path, reward_funcs=[length_reward, log_match_reward])
    before = torch.get_rng_state()
    weights = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    nbguard.audit(trainer=trainer)
    assert torch.equal(torch.get_rng_state(), before) and trainer.model.training
    assert all(torch.equal(v, trainer.model.state_dict()[k]) for k, v in weights.items())
