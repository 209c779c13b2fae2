"""Issue 43 item 1: rollouts sampled from another distribution than the one GRPO's log-probabilities score,
on real GRPOTrainer runs (transformers' generate, use_vllm=False) with a tiny model on the CPU.

The planted mismatch is trl#4159's: a temperature in ``generation_kwargs`` that the sampler applies and
the trainer's log-probabilities (built at the config's temperature) never see."""
from __future__ import annotations

import pytest
import torch
from rl_helpers import ending_model, grpo_trainer, length_reward

import nbguard
from nbguard.watcher.detectors.rollout_drift import KIND, LoggedDifferenceCheck, RolloutDriftSettings

torch.set_num_threads(1)


def peaked_model(seed: int = 0):
    """A tiny Qwen2 whose logits are spread far enough (head x 8) for the temperature to change what is
    sampled (a fresh tiny model's next-token distribution is nearly uniform at any temperature)."""
    model = ending_model(eos_logit=0.0, seed=seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


def rebuilt(trainer):
    """The trainer built again from its (fixed) args, as the fix's cell says, on a fresh copy of the model."""
    from trl import GRPOTrainer

    return GRPOTrainer(model=peaked_model(), reward_funcs=length_reward, args=trainer.args,
                       train_dataset=trainer.train_dataset, processing_class=trainer.processing_class)


def rollout_events(trainer) -> list:
    watch = nbguard.watch(trainer, verify=False)
    trainer.train()
    watch.detach()
    return [e for e in watch.events if e.kind == KIND]


def sampling_findings(**audit) -> list:
    return [f for f in nbguard.audit(**audit).findings if f.rule in ("rl-sampling-mismatch",
                                                                     "rl-importance-correction-path")]


def test_a_generation_temperature_the_trainer_never_sees(tmp_path):
    trainer = grpo_trainer(tmp_path, model=peaked_model(), generation_kwargs={"temperature": 0.5})
    (f,) = sampling_findings(trainer=trainer)
    assert f.rule == "rl-sampling-mismatch" and f.fixes == ["match-sampling-settings"]
    assert f.evidence["one_sided_settings"] == {"temperature": [0.5, 1.0]} and "trl#4159" in f.detail
    # verified by a re-audit of a shadow of the trainer; the user's args (and their generation_kwargs) untouched
    (verdict,) = nbguard.verify(f, trainer=trainer).verdicts
    assert verdict.verdict == "verified" and trainer.args.generation_kwargs == {"temperature": 0.5}

    (event,) = rollout_events(trainer)
    ev = event.evidence
    assert ev["reason"] == "sampled-tokens-atypical" and ev["one_sided_settings"] == {"temperature": [0.5, 1.0]}
    # sharper sampling: the sampled tokens are likelier than the trainer's distribution makes them
    assert ev["gap_per_token"] < 0 and ev["z"] <= -ev["threshold_z"] and ev["tokens"] >= 2 * ev["threshold_z"] ** 2
    assert "sharper" in event.message and "temperature 0.5 (trainer 1.0)" in event.message
    assert ev["fixes"] == ["match-sampling-settings"]
    assert not any(callable(trainer.__dict__.get(n)) for n in ("_compute_loss", "_generate_and_score_completions",
                                                               "_get_per_token_logps_and_entropies"))

    nbguard.fixes.apply("match-sampling-settings", args=trainer.args)
    assert trainer.args.generation_kwargs == {}
    fixed = rebuilt(trainer)
    assert sampling_findings(trainer=fixed) == [] and rollout_events(fixed) == []


def test_a_flatter_sampler_is_named_the_other_way(tmp_path):
    trainer = grpo_trainer(tmp_path, model=peaked_model(), generation_kwargs={"temperature": 2.0}, max_steps=10)
    (event,) = rollout_events(trainer)
    assert event.evidence["gap_per_token"] > 0 and "flatter" in event.message


@pytest.mark.parametrize("seed", [0, 1])
def test_the_healthy_twin_is_quiet(tmp_path, seed):
    trainer = grpo_trainer(tmp_path, model=peaked_model(seed), max_steps=12)
    assert sampling_findings(trainer=trainer) == [] and rollout_events(trainer) == []


def test_sampler_truncation_and_penalty_without_vllm(tmp_path):
    from trl import GRPOConfig

    args = GRPOConfig(output_dir=str(tmp_path), top_p=0.9, repetition_penalty=1.2, report_to="none", use_cpu=True)
    (f,) = sampling_findings(model=ending_model(), args=args)
    assert f.evidence["one_sided_settings"] == {"top_p": [0.9, 1.0], "repetition_penalty": [1.2, 1.0]}
    nbguard.fixes.apply("match-sampling-settings", args=args)
    assert (args.top_p, args.repetition_penalty) == (1.0, 1.0) and sampling_findings(model=ending_model(), args=args) == []


def test_vllm_truncation_under_the_correction_is_left_to_its_own_rule(tmp_path):
    from trl import GRPOConfig

    args = GRPOConfig(output_dir=str(tmp_path), use_vllm=True, top_p=0.9, report_to="none", use_cpu=True)
    rules = [f.rule for f in nbguard.audit(model=ending_model(), args=args).findings]
    assert "rl-vllm-truncated-sampling" in rules and "rl-sampling-mismatch" not in rules


@pytest.mark.parametrize(("settings", "reason"), [
    ({"importance_sampling_level": "sequence", "loss_type": "dapo"}, "sequence-ratio-summed"),
    ({"importance_sampling_level": "sequence", "loss_type": "vespo"}, "vespo-doubled"),
    ({"use_vllm": True, "vllm_importance_sampling_correction": False}, "vllm-uncorrected"),
])
def test_loss_paths_that_drop_or_double_the_correction(tmp_path, settings, reason):
    from trl import GRPOConfig

    args = GRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, **settings)
    (f,) = sampling_findings(model=ending_model(), args=args)
    assert f.rule == "rl-importance-correction-path" and f.evidence["reason"] == reason
    assert sampling_findings(model=ending_model(), args=GRPOConfig(output_dir=str(tmp_path), report_to="none",
                                                                    use_cpu=True)) == []


def test_liger_loss_of_older_trl_drops_the_vllm_ratio(tmp_path):
    from trl import GRPOConfig

    args = GRPOConfig(output_dir=str(tmp_path), use_vllm=True, report_to="none", use_cpu=True)
    args.use_liger_loss = True  # the field TRL releases before 1.x had (Liger's fused GRPO loss)
    (f,) = sampling_findings(model=ending_model(), args=args)
    assert f.evidence["reason"] == "liger-drops-ratio"


def _logged(differences):
    check = LoggedDifferenceCheck(RolloutDriftSettings())
    found = []
    for step, value in enumerate(differences):
        found += check.on_log(step, {"sampling/sampling_logp_difference/mean": value,
                                     "sampling/importance_sampling_ratio/max": 2.0})
    return found


def test_trls_logged_logprob_difference_rising_out_of_its_noise():
    # vLLM's numbers beside the trainer's: a floor that wanders by ~10% from log to log, then weights that lag
    steady = [0.010, 0.011, 0.0098, 0.0105, 0.0102, 0.0099, 0.0108, 0.0101]
    assert _logged(steady) == []
    ((kind, message, evidence),) = _logged(steady + [0.05, 0.08, 0.12])
    assert kind == KIND and evidence["reason"] == "logprob-difference-rising"
    assert evidence["difference_now"] == pytest.approx(0.05) and evidence["since_step"] == 7
    assert "after clipping" in message


def sampling_rollout(rerender: bool):
    """A custom rollout_func (TRL's hook) that samples with the trainer's model as TRL's own generate would,
    and returns each sampled token's log-probability; with ``rerender`` it then rebuilds the completion ids
    from the decoded text, as a multi-turn pipeline that renders the conversation again does: the
    template closes the assistant's turn with an EOS, also where the sampler was cut at the cap and never
    sampled one."""
    def rollout(prompts, trainer):
        tok, model = trainer.processing_class, trainer.model
        out = {"prompt_ids": [], "completion_ids": [], "logprobs": []}
        for prompt in prompts:
            ids = tok(prompt, add_special_tokens=False)["input_ids"]
            with torch.no_grad():
                gen = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                     do_sample=True, max_new_tokens=8, temperature=1.0, top_k=0, top_p=1.0,
                                     output_scores=True, return_dict_in_generate=True, pad_token_id=tok.pad_token_id,
                                     eos_token_id=tok.eos_token_id)
            sampled = gen.sequences[0, len(ids):].tolist()
            if tok.eos_token_id in sampled:
                sampled = sampled[:sampled.index(tok.eos_token_id) + 1]
            logprobs = [torch.log_softmax(gen.scores[t][0].float(), -1)[token].item() for t, token in enumerate(sampled)]
            text = tok.decode(sampled, skip_special_tokens=True)
            trained = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] if rerender else sampled
            out["prompt_ids"].append(ids)
            out["completion_ids"].append(trained)
            out["logprobs"].append(logprobs)
        return out

    return rollout


@pytest.mark.parametrize("rerender", [True, False], ids=["rendered-again", "sampled-ids"])
def test_a_rollout_that_trains_on_ids_it_did_not_sample(tmp_path, rerender):
    from trl import GRPOTrainer

    base = grpo_trainer(tmp_path, max_steps=3)
    trainer = GRPOTrainer(model=ending_model(eos_logit=0.0), reward_funcs=length_reward, args=base.args,
                          train_dataset=base.train_dataset, processing_class=base.processing_class,
                          rollout_func=sampling_rollout(rerender))
    events = rollout_events(trainer)
    assert trainer.__dict__["rollout_func"].__name__ == "rollout"  # the watch's wrapper is gone after detach
    if not rerender:
        assert events == []
        return
    (event,) = events
    ev = event.evidence
    assert ev["reason"] == "trained-ids-not-sampled" and ev["rows"] >= 1
    example = ev["examples"][0]
    assert example["completion_ids"] == example["logprobs"] + 1  # the EOS the template added, never sampled
    assert "not the ones that were sampled" in event.message
