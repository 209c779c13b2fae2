"""GRPO's rollouts against its trainer, read from the config before training: what the sampler applies
that the trainer's log-probabilities do not, and loss settings that drop or double the correction.

- A sampler setting on one side only (a ``generation_kwargs`` temperature, top_p/top_k/min_p, a
  repetition penalty: trl#4159, trl#6789): the completions are samples of another distribution than the
  one the loss scores, with no error. The watch measures the same on the sampled tokens
  (``rollout-logprob-mismatch``).
- The importance-sampling correction dropped or doubled: a sequence-level ratio under a loss that sums
  tokens (each sequence's ratio counted once per token: trl#5814), VESPO's own sequence weights taken
  at the sequence level again, Liger's fused GRPO loss that never multiplies the vLLM ratio in
  (Liger-Kernel#1082, trl#5031), vLLM rollouts with the correction off (trl#3867, trl#6945).
"""
from __future__ import annotations

from typing import Any

from ...introspect.trl import config_stack, trl_stack
from ...introspect.trl_sampling import describe, one_sided_settings, sampler_settings, scoring_temperature
from ..registry import finding, rule

SUMMING_LOSSES = ("bnpo", "dr_grpo", "dapo", "cispo")  # losses that sum the per-token terms over a batch
TRUNCATION = ("top_p", "top_k", "min_p")


def _grpo(ctx) -> tuple[Any, Any] | None:
    """(trainer or None, args) for a GRPO run: a GRPOTrainer, or a GRPOConfig given alone."""
    if ctx.trainer is not None:
        return (ctx.trainer, ctx.args or getattr(ctx.trainer, "args", None)) if trl_stack(ctx.trainer) == "grpo" \
            else None
    return (None, ctx.args) if config_stack(ctx.args) == "grpo" else None


def _corrected(args: Any) -> bool:
    """vLLM's log-probabilities are read (the importance-sampling correction or the off-policy mask)."""
    return getattr(args, "use_vllm", False) is True and (
        getattr(args, "vllm_importance_sampling_correction", False) is True
        or getattr(args, "off_policy_mask_threshold", None) is not None)


@rule("rl-sampling-mismatch", "warning")
def sampling_mismatch(ctx):
    """GRPO samples with a setting its log-probabilities do not apply (temperature, top_p/top_k/min_p, repetition penalty)."""
    run = _grpo(ctx)
    if run is None or run[1] is None:
        return None
    trainer, args = run
    sampler = sampler_settings(trainer, args)
    temperature = scoring_temperature(trainer, args)
    one_sided = one_sided_settings(sampler, temperature)
    greedy = (isinstance(sampler.get("temperature"), (int, float)) and sampler["temperature"] <= 1e-6) \
        or sampler.get("top_k") == 1
    if greedy:  # identical completions: rl-constant-loss-settings says so
        return None
    if _corrected(args):  # vLLM's truncation under the correction: rl-vllm-truncated-sampling says so
        one_sided = {k: v for k, v in one_sided.items() if k not in TRUNCATION}
    if not one_sided:
        return None
    engine = "vLLM" if getattr(args, "use_vllm", False) is True else "transformers' generate"
    return finding(
        "rl-sampling-mismatch", f"the sampler applies {', '.join(one_sided)}; the trainer's log-probabilities do not",
        f"GRPO's loss treats each completion as a sample of the distribution its log-probabilities score: a "
        f"full-vocabulary softmax of the logits at temperature {temperature:g}. {engine} samples with "
        f"{describe(one_sided)}, so the completions come from another distribution, and the policy gradient is "
        "biased with no error and no NaN (trl#4159, trl#6789). Set these in the config the trainer scores with, "
        "not in generation_kwargs, and sample the full vocabulary without a penalty; the watch measures the "
        "mismatch on the sampled tokens (rollout-logprob-mismatch).",
        {"sampler": sampler, "scoring_temperature": temperature,
         "one_sided_settings": {k: list(v) for k, v in one_sided.items()},
         "generation_kwargs": getattr(args, "generation_kwargs", None), "use_vllm": engine == "vLLM"},
        fixes=["match-sampling-settings"])


@rule("rl-importance-correction-path", "warning")
def importance_correction_path(ctx):
    """GRPO settings that drop or double the importance-sampling correction of the rollouts."""
    run = _grpo(ctx)
    if run is None or run[1] is None:
        return None
    args = run[1]
    loss, level = getattr(args, "loss_type", None), getattr(args, "importance_sampling_level", None)
    vllm, correction = getattr(args, "use_vllm", False) is True, \
        getattr(args, "vllm_importance_sampling_correction", False) is True
    facts = {"loss_type": loss, "importance_sampling_level": level, "use_vllm": vllm,
             "vllm_importance_sampling_correction": correction}
    found = []
    if level == "sequence" and loss in SUMMING_LOSSES:
        found.append(finding(
            "rl-importance-correction-path", f"a sequence-level ratio under loss_type={loss!r} is counted once per token",
            f"importance_sampling_level='sequence' gives each completion one ratio (the mean of its tokens' log-ratios), "
            f"but loss_type={loss!r} sums the per-token terms: the sequence's ratio is applied once per token, so long "
            "completions weigh in by their length twice over (trl#5814). Use loss_type='grpo' with sequence-level "
            "ratios (GSPO), or importance_sampling_level='token'.", {**facts, "reason": "sequence-ratio-summed"}))
    if loss == "vespo" and level == "sequence":
        found.append(finding(
            "rl-importance-correction-path", "VESPO's sequence weights are taken at the sequence level again",
            "loss_type='vespo' builds its own sequence-level weight from the tokens' log-ratios; "
            "importance_sampling_level='sequence' averages them first, so the correction is applied to an already "
            "reduced ratio. Keep importance_sampling_level='token' with VESPO.", {**facts, "reason": "vespo-doubled"}))
    if vllm and correction and getattr(args, "use_liger_loss", False) is True:
        found.append(finding(
            "rl-importance-correction-path", "Liger's GRPO loss drops the vLLM importance-sampling ratio",
            "With use_liger_loss, the loss is Liger's fused GRPO kernel, which never multiplies in the ratio of the "
            "trainer's to vLLM's log-probabilities that vllm_importance_sampling_correction computes: the correction "
            "is silently off (Liger-Kernel#1082, trl#5031). Turn use_liger_loss off while correcting vLLM rollouts.",
            {**facts, "use_liger_loss": True, "reason": "liger-drops-ratio"}))
    if vllm and not correction and getattr(args, "off_policy_mask_threshold", None) is None:
        found.append(finding(
            "rl-importance-correction-path", "vLLM rollouts with no importance-sampling correction",
            "vLLM computes the completions' log-probabilities with its own kernels (and, in server or asynchronous "
            "modes, weights that can lag the trainer's); with vllm_importance_sampling_correction=False and no "
            "off-policy mask, nothing corrects the difference, and the loss treats every rollout as on-policy "
            "(trl#3867, trl#6945). Keep the correction on (TRL's default).",
            {**facts, "reason": "vllm-uncorrected"}, severity="info"))
    return found or None
