"""Issue 34 item 7: RL runs with no learning signal offer the fixes their trainer's first batch can verify, on a
shadow of the real trainer with TRL's own code: GRPO/RLOO with equal rewards in every group, raise-temperature
(a generation); DPO with a loss ~0 from the start, lower-beta (the preference loss)."""
from __future__ import annotations

import pytest
import torch
from rl_helpers import grpo_trainer, length_reward

import nbguard

torch.set_num_threads(1)


def constant_reward(completions, **kwargs):
    return [1.0] * len(completions)


def _run(trainer):
    watch = nbguard.watch(trainer, verify=False)
    trainer.train()
    events = [e for e in watch.events if e.kind == "no-learning-signal"]
    assert len(events) == 1, [e.kind for e in watch.events]
    return watch, events[0]


def _untouched(trainer):
    """What a verification must leave as it was: args, sampling, metrics, logs, state, rewards, weights, RNG."""
    return (trainer.args.temperature, trainer.temperature, trainer.generation_config.temperature,
            {k: len(v) for k, v in trainer._metrics["train"].items()}, len(trainer._logs["prompt"]),
            trainer.state.num_input_tokens_seen, list(trainer.reward_funcs),
            [p.detach().clone() for p in trainer.model.parameters()], torch.get_rng_state())


def _same(before, after):
    *plain, weights, rng = before
    *plain_after, weights_after, rng_after = after
    assert plain == plain_after
    assert all(torch.equal(a, b) for a, b in zip(weights, weights_after)) and torch.equal(rng, rng_after)


@pytest.mark.parametrize("rloo", [False, True], ids=["grpo", "rloo"])
def test_sampling_too_cold_is_fixed_by_a_higher_temperature_verified_on_a_generation(tmp_path, rloo):
    # near-greedy: each prompt's four completions are the same text, so their length rewards are equal
    trainer = grpo_trainer(tmp_path, reward_funcs=[length_reward], temperature=1e-3, max_steps=4, rloo=rloo)
    watch, event = _run(trainer)
    assert event.evidence["fixes"] == ["raise-temperature"]
    logged = [h["frac_reward_zero_std"] for h in trainer.state.log_history if "frac_reward_zero_std" in h]
    assert logged and all(share == 1.0 for share in logged)

    before = _untouched(trainer)
    verification = nbguard.verify(event)
    _same(before, _untouched(trainer))
    verdict = verification.verdict("raise-temperature")
    assert verdict.verdict == "verified", verdict.reason
    assert "frac_reward_zero_std 1 -> " in verdict.reason and verdict.changes["args.temperature"].startswith("0.001 -> 1.2")
    assert verification.notes[0] == "without a fix: frac_reward_zero_std 1 on the trainer's first batch"

    # the verified cell is the fix: a trainer built again from the fixed args learns from the same model
    exec(verdict.code, {"trainer": trainer})
    assert trainer.args.temperature == 1.2
    rebuilt = type(trainer)(model=trainer.model, reward_funcs=[length_reward], args=trainer.args,
                            train_dataset=trainer.train_dataset, processing_class=trainer.processing_class)
    again = nbguard.watch(rebuilt, verify=False)
    rebuilt.train()
    assert [e.kind for e in again.events] == []
    assert any(h["frac_reward_zero_std"] < 1.0 for h in rebuilt.state.log_history if "frac_reward_zero_std" in h)


def test_a_reward_that_scores_everything_alike_is_not_fixed_by_sampling(tmp_path):
    trainer = grpo_trainer(tmp_path, reward_funcs=[constant_reward], max_steps=4)
    _, event = _run(trainer)
    before = _untouched(trainer)
    verdict = nbguard.verify(event).verdict("raise-temperature")
    _same(before, _untouched(trainer))
    assert verdict.verdict == "not enough" and "still got equal rewards" in verdict.reason


def test_an_event_without_its_trainer_is_refused_by_name():
    from nbguard.findings import Event

    with pytest.raises(ValueError, match="verified on its trainer's first batch: pass trainer="):
        nbguard.verify(Event("no-learning-signal", 3, "every group's 4 completions got the same reward"))


def _far_reference_dpo(tmp_path, **overrides):
    """DPO whose reference finds the chosen answers' words very unlikely: the log-ratio margin is huge, the loss
    ~0 from the first step (the sigmoid saturated), the gradient ~0."""
    from rl_helpers import dpo_trainer, preference_rows

    from nbguard.testing import TINY_VOCAB, tiny_qwen2

    rows = preference_rows()
    chosen = {int(w[1:]) for r in rows for w in r["chosen"].split()}
    rejected = {int(w[1:]) for r in rows for w in r["rejected"].split()}
    reference = tiny_qwen2()
    bias = torch.zeros(TINY_VOCAB)
    bias[sorted(chosen - rejected)] = overrides.pop("bias", -100.0)
    reference.lm_head.bias = torch.nn.Parameter(bias)
    return dpo_trainer(tmp_path, rows=rows, ref_model=reference, **overrides)


def _dpo_untouched(trainer):
    return (trainer.args.beta, trainer.beta, {k: len(v) for k, v in trainer._metrics["train"].items()},
            [p.detach().clone() for p in trainer.model.parameters()], torch.get_rng_state())


def _dpo_same(before, after):
    *plain, weights, rng = before
    *plain_after, weights_after, rng_after = after
    assert plain == plain_after
    assert all(torch.equal(a, b) for a, b in zip(weights, weights_after)) and torch.equal(rng, rng_after)


def test_a_saturated_dpo_loss_is_fixed_by_a_lower_beta_verified_on_the_preference_loss(tmp_path):
    trainer = _far_reference_dpo(tmp_path, max_steps=3)
    watch = nbguard.watch(trainer, verify=False)
    trainer.train()
    (event,) = [e for e in watch.events if e.kind == "no-preference-signal"]
    assert event.evidence["reason"] == "loss-near-zero-at-start" and event.evidence["fixes"] == ["lower-beta"]
    before = _dpo_untouched(trainer)
    verdict = nbguard.verify(event).verdict("lower-beta")
    _dpo_same(before, _dpo_untouched(trainer))
    assert verdict.verdict == "verified", verdict.reason
    assert verdict.changes["args.beta"].startswith("0.1 -> 0.01") and "no longer saturated" in verdict.reason
    loss_before, loss_after = (float(x) for x in verdict.changes["preference loss"].split(" -> "))
    assert loss_before < 1e-3 and loss_after > 0.1  # measured: 1.73e-05 -> 0.197
    # the verified cell is the fix: a trainer built again from the fixed args starts with a loss that has a gradient
    exec(verdict.code, {"trainer": trainer})
    assert trainer.args.beta == 0.01
    rebuilt = type(trainer)(model=trainer.model, ref_model=trainer.ref_model, args=trainer.args,
                            train_dataset=trainer.train_dataset, processing_class=trainer.processing_class)
    again = nbguard.watch(rebuilt, verify=False)
    rebuilt.train()
    assert [e.kind for e in again.events] == []
    assert next(h["loss"] for h in rebuilt.state.log_history if "loss" in h) > 1e-3


def test_a_margin_too_large_for_the_lower_beta_is_not_enough(tmp_path):
    trainer = _far_reference_dpo(tmp_path, bias=-1000.0, max_steps=3)
    watch = nbguard.watch(trainer, verify=False)
    trainer.train()
    (event,) = [e for e in watch.events if e.kind == "no-preference-signal"]
    verdict = nbguard.verify(event).verdict("lower-beta")
    assert verdict.verdict == "not enough" and "still ~0 under it" in verdict.reason
    # a lower beta still: verified (measured 1.96e-44 -> 0.201), the option reaches the shadow and the cell
    verdict = nbguard.verify(event, options={"lower-beta": {"beta": 0.001}}).verdict("lower-beta")
    assert verdict.verdict == "verified" and "min(trainer.args.beta, 0.001)" in verdict.code


def test_a_trainer_whose_code_refuses_the_shadow_gets_not_checked_never_an_exception(tmp_path, monkeypatch):
    trainer = _far_reference_dpo(tmp_path, max_steps=3)
    watch = nbguard.watch(trainer, verify=False)
    trainer.train()
    (event,) = [e for e in watch.events if e.kind == "no-preference-signal"]

    def refuses(self, *args, **kwargs):
        raise RuntimeError("this TRL cannot run a copied trainer")

    monkeypatch.setattr(type(trainer), "compute_loss", refuses)
    verdict = nbguard.verify(event).verdict("lower-beta")
    assert verdict.verdict == "not checked"
    assert verdict.reason == ("the trainer's first batch could not be run on a shadow: RuntimeError: this TRL cannot "
                              "run a copied trainer")
