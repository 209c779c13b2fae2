"""Issue 34 item 7: a GRPO run with no learning signal (equal rewards in every group) offers the fix that a
generation step can verify: raise-temperature, sampled on a shadow of the real trainer with TRL's own code."""
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
    assert verification.notes[0].startswith("without a fix: frac_reward_zero_std 1 on the first generation batch")

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

    with pytest.raises(ValueError, match="verified on a generation of its trainer: pass trainer="):
        nbguard.verify(Event("no-learning-signal", 3, "every group's 4 completions got the same reward"))
