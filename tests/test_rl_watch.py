"""Issue 20 item 2: TRL's GRPO, RLOO, DPO and KTO trainers as stacks the watch knows, on real runs
with tiny models (generation included) on the CPU."""
from __future__ import annotations

import math

import pytest
import torch
from rl_helpers import (
    dpo_trainer,
    ending_model,
    grpo_trainer,
    kto_trainer,
    length_reward,
    log_match_reward,
    preference_rows,
)
from transformers import TrainerCallback

import nbguard

torch.set_num_threads(1)


def kinds(watch) -> list[str]:
    return [e.kind for e in watch.events]


def watched(trainer):
    watch = nbguard.watch(trainer, verify=False)
    trainer.train()
    return watch


def test_a_reward_of_minus_inf_is_named_at_the_first_step(tmp_path):
    trainer = grpo_trainer(tmp_path, reward_funcs=[length_reward, log_match_reward])
    watch = watched(trainer)
    assert kinds(watch) == ["nonfinite-reward"]  # no generic dead-run on top of it
    (event,) = watch.events
    assert event.step == 0 and event.evidence["reward_function"] == "log_match_reward"
    assert event.evidence["value"] == -math.inf and "w5" not in event.evidence["example_completion"].split()
    assert event.evidence["calls_with_nonfinite"] == 6 and event.evidence["last_step"] == 5
    assert "'log_match_reward' returned -inf" in event.message


def test_the_reward_tap_hands_back_the_same_rewards_and_leaves_on_detach(tmp_path):
    seen = []

    def recorded(completions, **kwargs):
        out = length_reward(completions)
        seen.append(out)
        return out

    trainer = grpo_trainer(tmp_path, reward_funcs=[recorded], max_steps=2)
    watch = nbguard.watch(trainer, verify=False)
    assert trainer.reward_funcs[0] is not recorded  # tapped
    trainer.train()
    assert [h["reward"] for h in trainer.state.log_history if "reward" in h] == \
        pytest.approx([sum(v) / len(v) for v in seen])
    watch.detach()
    assert trainer.reward_funcs[0] is recorded


@pytest.mark.parametrize("rloo", [False, True], ids=["grpo", "rloo"])
def test_healthy_generating_runs_raise_nothing(tmp_path, rloo):
    watch = watched(grpo_trainer(tmp_path, rloo=rloo, max_steps=8))
    assert watch.events == [] and watch.step == 8


def test_equal_rewards_in_every_group_is_no_learning_signal(tmp_path):
    def constant(completions, **kwargs):
        return [1.0] * len(completions)

    watch = watched(grpo_trainer(tmp_path, reward_funcs=[constant]))
    assert kinds(watch) == ["no-learning-signal"]
    (event,) = watch.events
    assert event.step == 2 and event.evidence["generations"] == 3 and event.evidence["group_size"] == 4
    logged = [h for h in watch.trainer.state.log_history if "frac_reward_zero_std" in h]
    assert all(h["frac_reward_zero_std"] == 1.0 and h["grad_norm"] == 0.0 for h in logged)


def test_every_completion_cut_at_the_cap(tmp_path):
    watch = watched(grpo_trainer(tmp_path, model=ending_model(eos_logit=-30.0)))
    assert "completions-truncated" in kinds(watch)
    event = next(e for e in watch.events if e.kind == "completions-truncated")
    assert event.step == 2 and event.evidence["max_completion_length"] == 8
    logged = [h for h in watch.trainer.state.log_history if "completions/clipped_ratio" in h]
    assert all(h["completions/clipped_ratio"] == 1.0 for h in logged)


@pytest.mark.parametrize("make", [dpo_trainer, kto_trainer], ids=["dpo", "kto"])
def test_healthy_preference_runs_raise_nothing(tmp_path, make):
    watch = watched(make(tmp_path))
    assert watch.events == [] and watch.step == 6


def test_chosen_identical_to_rejected_is_no_preference_signal(tmp_path):
    watch = watched(dpo_trainer(tmp_path, rows=preference_rows(identical=True)))
    assert kinds(watch) == ["no-preference-signal"]
    (event,) = watch.events
    assert event.evidence["reason"] == "chosen-identical-to-rejected" and event.evidence["loss_at_ln2"]
    assert event.evidence["since_step"] == 0 and event.evidence["logged_steps"] == 3 and event.step == 2


def test_a_policy_that_never_leaves_its_reference(tmp_path):
    watch = watched(dpo_trainer(tmp_path, learning_rate=0.0))
    assert kinds(watch) == ["no-preference-signal"]
    assert watch.events[0].evidence["reason"] == "reference-equals-policy"


class NanInTraining(torch.nn.Module):
    """SiLU whose forward turns NaN in the training pass once armed (generation runs without grad)."""

    def __init__(self):
        super().__init__()
        self.armed = False

    def forward(self, x):
        out = torch.nn.functional.silu(x)
        return out * float("nan") if self.armed and torch.is_grad_enabled() else out


class ArmAt(TrainerCallback):
    def __init__(self, module, step):
        self.module, self.step = module, step

    def on_step_begin(self, args, state, control, **kwargs):
        self.module.armed = state.global_step == self.step


@pytest.mark.parametrize("make", [grpo_trainer, dpo_trainer], ids=["grpo", "dpo"])
def test_a_nan_in_the_policys_forward_is_localised(tmp_path, make):
    model = ending_model()
    act = model.model.layers[1].mlp.act_fn = NanInTraining()
    trainer = make(tmp_path, model=model, max_steps=4)  # DPO: the reference is a copy whose act_fn never arms
    trainer.add_callback(ArmAt(act, 2))
    # skip: the NaN update is dropped, so the next generation samples from finite weights again
    watch = nbguard.watch(trainer, verify=False, policy="skip")
    trainer.train()
    (event,) = watch.events
    assert event.kind == "nonfinite-loss" and event.step == 2 and watch.step == 4
    assert event.origin("forward").module == "model.layers.1.mlp.act_fn"


def dropout_policy():
    model = ending_model()
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.5  # a checkpoint trained with attention dropout
    return model


def test_dropout_moves_the_ratio_on_the_first_inner_step(tmp_path):
    # num_iterations=2: TRL computes the old log-probabilities in a forward of their own
    trainer = grpo_trainer(tmp_path, model=dropout_policy(), num_iterations=2, max_steps=2)
    watch = watched(trainer)
    assert kinds(watch) == ["ratio-mismatch"]
    (event,) = watch.events
    assert event.evidence["clip_ratio/region_mean"] > 0 and event.evidence["dropout"] == {
        f"model.layers.{i}.self_attn": 0.5 for i in range(2)}
    assert nbguard.fixes.apply("disable-dropout", model=trainer.model).changed
    assert watched(grpo_trainer(tmp_path, model=trainer.model, num_iterations=2, max_steps=2)).events == []


def test_dropout_without_a_separate_old_forward_is_not_a_mismatch(tmp_path):
    assert watched(grpo_trainer(tmp_path, model=dropout_policy(), max_steps=2)).events == []


def test_a_loss_near_zero_from_the_first_step(tmp_path):
    from nbguard.testing import TINY_VOCAB, tiny_qwen2

    rows = preference_rows()
    chosen = {int(w[1:]) for r in rows for w in r["chosen"].split()}
    rejected = {int(w[1:]) for r in rows for w in r["rejected"].split()}
    reference = tiny_qwen2()  # a reference that finds the chosen answers' words very unlikely
    bias = torch.zeros(TINY_VOCAB)
    bias[sorted(chosen - rejected)] = -100.0
    reference.lm_head.bias = torch.nn.Parameter(bias)
    watch = watched(dpo_trainer(tmp_path, rows=rows, ref_model=reference))
    assert kinds(watch) == ["no-preference-signal"]
    (event,) = watch.events
    assert event.evidence["reason"] == "loss-near-zero-at-start" and event.evidence["loss"] < 1e-3


def test_a_failure_inside_the_reward_checks_never_reaches_the_run(tmp_path, monkeypatch):
    from nbguard.watcher.detectors.rl import RewardChecks

    def broken(self, call, step):
        raise RuntimeError("nbguard bug")

    monkeypatch.setattr(RewardChecks, "observe", broken)
    trainer = grpo_trainer(tmp_path, max_steps=3)
    watch = watched(trainer)
    assert trainer.state.global_step == 3 and watch.events[0].kind == "watch-error"
    assert "nbguard bug" in watch.events[0].message and not watch.attached  # stepped aside at a safe point
    assert trainer.reward_funcs[0] is length_reward  # and took its tap with it


def test_the_users_reward_error_reaches_the_user_unchanged(tmp_path):
    error = KeyError("answer")

    def needs_answer(completions, **kwargs):
        raise error

    trainer = grpo_trainer(tmp_path, reward_funcs=[needs_answer], max_steps=1)
    watch = nbguard.watch(trainer, verify=False)
    with pytest.raises(KeyError) as raised:
        trainer.train()
    assert raised.value is error and watch.events == []


def test_a_reward_model_that_scores_everything_alike(tmp_path):
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from nbguard.testing import TINY_VOCAB, word_tokenizer

    torch.manual_seed(0)
    scorer = Qwen2ForSequenceClassification(Qwen2Config(
        vocab_size=TINY_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, num_labels=1, pad_token_id=2))
    torch.nn.init.zeros_(scorer.score.weight)  # an untrained score head: 0 for every completion
    trainer = grpo_trainer(tmp_path, reward_funcs=[scorer], reward_processing_classes=[word_tokenizer()], max_steps=4)
    watch = watched(trainer)
    assert trainer.reward_funcs[0] is scorer  # a model is not tapped: TRL dispatches on its type
    assert kinds(watch) == ["no-learning-signal"]
    (event,) = watch.events
    assert event.evidence["reason"] == "frac-reward-zero-std" and event.evidence["since_step"] == 0
