"""Issue 34 item 1: RL runs that go wrong without a NaN, on real TRL 1.16 GRPO runs with tiny models
(generation with ``generate``) on the CPU: a policy whose entropy or completion length collapses while
its reward stays flat, a KL to the reference far from 0 on step 0, ``beta=0`` (no KL at all) left
alone, and vLLM sampling settings that bias the importance ratio (from the config alone)."""
from __future__ import annotations

import copy
import math
import random
import statistics

import pytest
import torch
from rl_helpers import ending_model, grpo_trainer
from transformers import TrainerCallback

import nbguard
from nbguard.testing import tiny_qwen2
from nbguard.watcher.detectors.rl import TRLChecks

torch.set_num_threads(1)
COLLAPSE_LR = 0.05  # high enough that a tiny policy narrows within 12 steps


def kinds(watch) -> list[str]:
    return [e.kind for e in watch.events]


def coin_reward(seed: int = 0):
    rng = random.Random(seed)

    def coin(completions, **kwargs):
        """A reward that teaches nothing: a coin per completion, unrelated to its text."""
        return [rng.random() for _ in completions]

    return coin


def low_words_reward(completions, **kwargs):
    """A reward the policy can learn: the share of its words among w3..w6."""
    return [sum(w in ("w3", "w4", "w5", "w6") for w in c.split()) / max(len(c.split()), 1) for c in completions]


def logged(trainer, key: str) -> list[float]:
    return [h[key] for h in trainer.state.log_history if key in h]


@pytest.fixture(scope="module")
def collapsed(tmp_path_factory):
    """A real run whose policy collapses: a coin-flip reward and a high learning rate, 12 steps."""
    trainer = grpo_trainer(tmp_path_factory.mktemp("collapse"), reward_funcs=[coin_reward()], max_steps=12,
                           learning_rate=COLLAPSE_LR)
    watch = nbguard.watch(trainer, verify=False)
    trainer.train()
    watch.detach()
    return trainer, watch


@pytest.fixture(scope="module")
def steady(tmp_path_factory):
    """Its healthy twin: the same coin-flip reward at an ordinary learning rate; the policy stays broad."""
    trainer = grpo_trainer(tmp_path_factory.mktemp("steady"), reward_funcs=[coin_reward()], max_steps=12)
    watch = nbguard.watch(trainer, verify=False)
    trainer.train()
    watch.detach()
    return trainer, watch


def test_entropy_collapse_under_a_reward_that_teaches_nothing(collapsed):
    trainer, watch = collapsed
    assert "policy-collapse" in kinds(watch)
    (event,) = [e for e in watch.events if e.kind == "policy-collapse"]
    ev = event.evidence
    entropy, reward = logged(trainer, "entropy"), logged(trainer, "reward")
    assert ev["reason"] == "entropy-collapse"
    assert ev["entropy_early"] == pytest.approx(statistics.median(entropy[:3]))
    # raised at the first log whose last 3 entropies are under a fifth of the early level
    at = next(i for i in range(6, len(entropy) + 1) if statistics.median(entropy[i - 3:i]) < 0.2 * ev["entropy_early"])
    assert event.step == at - 1 and ev["recent_steps"] == [at - 3, at - 1]
    assert ev["entropy_now"] == pytest.approx(statistics.median(entropy[at - 3:at])) and ev["fraction"] < 0.2
    assert ev["reward_now"] <= ev["reward_early"] + 0.5 * ev["reward_std_early"]
    assert ev["reward_early"] == pytest.approx(statistics.median(reward[:3]))
    assert ev["fixes"] == ["raise-temperature", "add-entropy-bonus"]
    assert f"fell from {ev['entropy_early']:.3g} to {ev['entropy_now']:.3g}" in event.message
    assert not math.isnan(trainer.state.log_history[-2]["loss"])  # no NaN anywhere: nothing else would say it


def test_a_policy_that_narrows_while_its_reward_rises_is_learning(tmp_path):
    # the same learning rate and the same entropy collapse, but the reward goes from ~0 to 1
    trainer = grpo_trainer(tmp_path, reward_funcs=[low_words_reward], max_steps=12, learning_rate=COLLAPSE_LR)
    watch = nbguard.watch(trainer, verify=False)
    trainer.train()
    entropy, reward = logged(trainer, "entropy"), logged(trainer, "reward")
    assert statistics.median(entropy[-3:]) < 0.2 * statistics.median(entropy[:3])  # it did narrow
    assert statistics.median(reward[-3:]) > statistics.median(reward[:3]) + 0.3
    assert "policy-collapse" not in kinds(watch)


def test_a_steady_run_with_a_flat_reward_is_quiet(steady):
    trainer, watch = steady
    assert watch.events == []
    assert min(logged(trainer, "entropy")) > 0.5 * max(logged(trainer, "entropy"))


def _feed(trainer, logs: list[dict]) -> list:
    checks = TRLChecks(trainer, on_error=lambda exc: None)
    found = []
    for row in logs:
        found += checks.on_log(row["step"] - 1, dict(row))
    return found


def test_completion_length_halving_while_the_reward_stays_flat(steady):
    """A tiny policy does not learn to stop early within seconds, so this drives the real checks with
    the metrics the real steady run logged (TRL 1.16's own dicts), its ``completions/mean_length``
    shrunk step by step to a fifth of what the run logged, as a length collapse does; the reward series is the
    run's (flat: a coin-flip reward)."""
    trainer, _ = steady
    logs = [h for h in trainer.state.log_history if "completions/mean_length" in h]
    assert len(logs) == 12
    shrunk = [{**h, "completions/mean_length": h["completions/mean_length"] * (1 - 0.8 * i / (len(logs) - 1))}
              for i, h in enumerate(logs)]
    found = _feed(trainer, shrunk)
    assert [(kind, ev["reason"]) for kind, _, ev in found] == [("policy-collapse", "length-collapse")]
    _, message, ev = found[0]
    assert ev["length_now"] <= 0.5 * ev["length_early"] and "mean completion length fell" in message
    # the run as logged, and the same shrinking length while the reward rises: quiet
    assert _feed(trainer, logs) == []
    spread = statistics.median(h["reward_std"] for h in logs[:3])
    rising = [{**h, "reward": h["reward"] + 2 * spread * i} for i, h in enumerate(shrunk)]
    assert _feed(trainer, rising) == []


def test_the_fixes_change_what_the_rebuilt_trainer_does_on_its_next_step(collapsed, tmp_path):
    """raise-temperature and add-entropy-bonus change the args; the trainer built again from them (same
    collapsed policy) samples hotter on its very next step: the logged entropy rises at once."""
    from datasets import Dataset
    from trl import GRPOTrainer

    from nbguard.testing import word_tokenizer

    trainer, _ = collapsed
    policy = trainer.model

    def one_step(args):
        args = copy.deepcopy(args)
        args.max_steps, args.learning_rate, args.output_dir = 1, 0.0, str(tmp_path)
        again = GRPOTrainer(model=policy, reward_funcs=[coin_reward(1)], args=args,
                            train_dataset=Dataset.from_list([{"prompt": "w9 w10 w11 w12"}] * 16),
                            processing_class=word_tokenizer())
        torch.manual_seed(0)
        again.train()
        return again.state.log_history[0]

    before = one_step(trainer.args)
    args = copy.deepcopy(trainer.args)
    assert nbguard.fixes.apply("raise-temperature", args=args, temperature=2.0).changed == {
        "args.temperature": "1.0 -> 2.0 (takes effect when the trainer is built again from these args)"}
    assert not nbguard.fixes.apply("raise-temperature", args=args, temperature=2.0).changed  # idempotent
    assert nbguard.fixes.apply("add-entropy-bonus", args=args).changed
    after = one_step(args)
    assert after["entropy"] > 2 * before["entropy"]
    assert after["entropy_coef"] == 0.01 and "entropy_coef" not in before
    cell = nbguard.fixes.code("raise-temperature", args="grpo_args", temperature=2.0)
    namespace = {"grpo_args": copy.deepcopy(trainer.args)}
    exec(cell, namespace)  # the cell a user keeps does what apply did
    assert namespace["grpo_args"].temperature == 2.0


def _checkpoint(tmp_path):
    path = tmp_path / "checkpoint"
    tiny_qwen2().save_pretrained(path)
    return path


@pytest.mark.parametrize("moved", [False, True], ids=["same-weights", "weights-changed-after-loading"])
def test_a_reference_that_is_not_the_initial_policy(tmp_path, moved):
    """TRL builds GRPO's reference (beta > 0) from the policy's checkpoint path. A policy changed in memory
    after loading (here: its weights nudged, as an SFT step or a merge would) is no longer that reference,
    and the KL is far from 0 on step 0, where it must be 0."""
    from transformers import AutoModelForCausalLM

    path = _checkpoint(tmp_path)
    policy = AutoModelForCausalLM.from_pretrained(path)
    if moved:
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.02)
    trainer = grpo_trainer(tmp_path, model=policy, beta=0.04, max_steps=2)
    assert trainer.ref_model is not None and trainer.ref_model is not policy
    watch = nbguard.watch(trainer, verify=False)
    trainer.train()
    first_kl = logged(trainer, "kl")[0]
    if not moved:
        assert first_kl < 1e-6 and watch.events == []
        return
    assert first_kl > 1e-3
    assert kinds(watch) == ["kl-at-start"]
    (event,) = watch.events
    ev = event.evidence
    assert event.step == 0 and ev["kl"] == pytest.approx(first_kl) and ev["beta"] == 0.04
    assert ev["reference"]["loaded_from"] == str(path) and ev["reference_kind"] == "ref_model"
    # one optimizer step moves the policy by ~lr; a different model is far further from the reference
    assert ev["weights"]["relative_l2"] > 0.3 and ev["weights"]["only_in_policy"] == 0
    assert f"{first_kl:.3g} on step 0" in event.message


class OldTRLNanKL(TrainerCallback):
    """Logs ``kl`` as NaN, as TRL did with beta=0 before it stopped logging it (trl#4040)."""

    def __init__(self, inject: bool = True):
        self.inject = inject
        self.seen: list[float | None] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is not None and "reward" in logs:
            if self.inject:
                logs["kl"] = float("nan")
            self.seen.append(logs.get("kl"))


def test_beta_zero_has_no_kl_and_raises_nothing(tmp_path):
    trainer = grpo_trainer(tmp_path, max_steps=3)  # GRPOConfig's default beta is 0: no reference at all
    assert trainer.args.beta == 0.0 and trainer.ref_model is None
    trainer.add_callback(before := OldTRLNanKL())  # runs before the watch's callback
    watch = nbguard.watch(trainer, verify=False)
    trainer.add_callback(after := OldTRLNanKL(inject=False))  # runs after it: what the watch was handed
    trainer.train()
    assert not any("kl" in h for h in trainer.state.log_history)  # TRL 1.16 logs no KL at beta 0
    assert len(after.seen) == 3 and all(math.isnan(v) for v in after.seen) and len(before.seen) == 3
    assert watch.events == [] and watch.step == 3


def test_a_nan_kl_with_beta_above_zero_at_step_0_is_not_a_mismatch(steady):
    """The reference check judges a finite KL with beta > 0 only (a NaN there is not a reference that differs);
    driven with hand-made log dicts on a real trainer's checks."""
    trainer, _ = steady
    checks = TRLChecks(trainer, on_error=lambda exc: None)
    assert checks.reference.beta == 0.0 and checks.on_log(0, {"kl": 0.5, "reward": 0.5}) == []  # beta 0: not judged
    checks = TRLChecks(trainer, on_error=lambda exc: None)
    checks.reference.beta, checks.reference.done = 0.04, False
    assert checks.on_log(0, {"kl": float("nan"), "reward": 0.5}) == []
    assert [k for k, _, _ in checks.on_log(0, {"kl": 0.5, "reward": 0.5})] == ["kl-at-start"]


# ---- the audit: vLLM sampling that biases the importance ratio (config only; vllm is not needed) ----------
def _grpo_args(tmp_path, **settings):
    from trl import GRPOConfig

    return GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", **settings)


def _vllm_findings(tmp_path, **settings):
    result = nbguard.audit(model=tiny_qwen2(), args=_grpo_args(tmp_path, **settings))
    return [f for f in result.findings if f.rule == "rl-vllm-truncated-sampling"]


@pytest.mark.parametrize("settings, named", [
    ({"top_p": 0.9}, "top_p=0.9"),
    ({"top_k": 50}, "top_k=50"),
    ({"generation_kwargs": {"min_p": 0.05}}, "min_p=0.05"),
])
def test_vllm_with_truncated_sampling_biases_the_importance_ratio(tmp_path, settings, named):
    (finding,) = _vllm_findings(tmp_path, use_vllm=True, **settings)
    assert named in finding.title and finding.severity.value == "warning"
    assert finding.evidence["vllm_importance_sampling_correction"] is True
    assert finding.fixes == ["full-vocabulary-sampling"]


@pytest.mark.parametrize("settings", [
    {"use_vllm": True},  # top_p=1.0, top_k=0, min_p=None: nothing cut
    {"use_vllm": False, "top_p": 0.9},  # generate: the trainer's own log-probabilities on both sides
    {"use_vllm": True, "top_p": 0.9, "vllm_importance_sampling_correction": False},  # nothing reads vLLM's
])
def test_untruncated_or_uncorrected_sampling_is_quiet(tmp_path, settings):
    assert _vllm_findings(tmp_path, **settings) == []


def test_full_vocabulary_sampling_clears_the_finding(tmp_path):
    import copy

    args = _grpo_args(tmp_path, use_vllm=True, top_p=0.9, generation_kwargs={"top_k": 20})
    trial = copy.copy(args)  # what a verification applies it to: the user's args must not change
    assert nbguard.fixes.apply("full-vocabulary-sampling", args=trial).changed
    assert args.generation_kwargs == {"top_k": 20} and trial.generation_kwargs == {}
    assert nbguard.fixes.apply("full-vocabulary-sampling", args=args).changed
    assert (args.top_p, args.top_k, args.min_p, args.generation_kwargs) == (1.0, 0, None, {})
    result = nbguard.audit(model=tiny_qwen2(), args=args)
    assert "rl-vllm-truncated-sampling" not in [f.rule for f in result.findings]


def test_the_weight_distance_read_in_chunks_is_the_whole_tensors_distance(monkeypatch):
    from nbguard.watcher.detectors import rl

    policy, reference = tiny_qwen2(seed=0), tiny_qwen2(seed=1)
    with torch.no_grad():
        pairs = list(zip(policy.parameters(), reference.parameters()))
        direct = math.sqrt(sum(float((p - r).double().pow(2).sum()) for p, r in pairs)
                           / sum(float(r.double().pow(2).sum()) for _, r in pairs))
    monkeypatch.setattr(rl, "WEIGHT_CHUNK", 7)  # chunks that split every tensor, unevenly
    found = rl.weight_distance(policy, reference)
    assert found["relative_l2"] == pytest.approx(direct, rel=1e-9) and found["only_in_reference"] == 0
    assert rl.weight_distance(policy, copy.deepcopy(policy))["relative_l2"] == 0.0
