"""Rules about TRL's RL and preference trainers (GRPO, RLOO, DPO, KTO): settings that leave the run
without a learning signal before it starts, and reward functions that fail on real completions.

GRPO and RLOO take each prompt's completions as a group and learn from how their rewards differ:
with few completions per prompt many groups are flat (zero advantage, zero gradient), completions
all sampled greedily are identical, and answers cut at ``max_completion_length`` are scored
unfinished. DPO and KTO with ``beta=0`` have a constant loss (ln 2 for DPO's sigmoid). GRPO that
samples with vLLM and truncates the sampling distribution (top_p/top_k/min_p) corrects its importance
ratio with log-probabilities of another distribution than the one it trains (trl#6789).
"""
from __future__ import annotations

import math
import statistics
from typing import Any

import torch

from ...introspect.modes import in_eval_mode
from ...introspect.trl import (
    GENERATING,
    PREFERENCE,
    completion_cap,
    config_stack,
    group_size,
    plain_reward_functions,
    trl_stack,
)
from ...step.capture import preserved_rng
from ..registry import finding, rule

MIN_GROUP = 4  # below this a binary reward leaves 2 x 0.5**G of the groups flat (50% at G=2, 25% at G=3)
ANSWER_COLUMNS = ("completion", "answer", "solution", "ground_truth", "chosen")
SAMPLED_ROWS = 8  # dataset rows read to measure the answers' length
CHECK_PROMPTS, CHECK_PER_PROMPT, CHECK_TOKENS = 2, 2, 16  # the reward check's generation budget


def _args(ctx) -> Any:
    return ctx.args if ctx.args is not None else getattr(ctx.trainer, "args", None)


@rule("rl-few-generations", "warning")
def few_generations(ctx):
    """GRPO/RLOO with fewer than 4 completions per prompt: many groups have no reward spread, so no gradient."""
    if ctx.trainer is None or trl_stack(ctx.trainer) not in GENERATING:
        return None
    size = group_size(ctx.trainer)
    if size is None or size >= MIN_GROUP:
        return None
    flat = 2 * 0.5 ** size
    return finding(
        "rl-few-generations", f"num_generations={size}: a group of {size} often has no reward spread",
        f"The advantage of a completion is its reward minus its group's mean (and over the group's std): a group "
        f"whose {size} rewards are equal teaches nothing. With a pass/fail reward that succeeds half the time, "
        f"{flat:.0%} of the groups are flat; the logged frac_reward_zero_std says how many are. Generate at least "
        f"{MIN_GROUP} (TRL's default is 8) and keep the generation batch a multiple of it.",
        {"num_generations": size, "flat_groups_at_p_half": flat})


@rule("rl-constant-loss-settings", "error")
def constant_loss_settings(ctx):
    """Settings that make the loss constant: greedy sampling in GRPO/RLOO, beta=0 in DPO/KTO."""
    stack = trl_stack(ctx.trainer) if ctx.trainer is not None else None
    args = _args(ctx)
    if stack is None or args is None:
        return None
    if stack in GENERATING:
        temperature, top_k = getattr(args, "temperature", None), getattr(args, "top_k", None)
        greedy = (isinstance(temperature, (int, float)) and temperature <= 1e-6) or top_k == 1
        if not greedy:
            return None
        return finding(
            "rl-constant-loss-settings", "every completion of a prompt is the same: greedy sampling",
            f"With temperature={temperature} and top_k={top_k} generation picks the most likely token every "
            f"time, so a prompt's {group_size(ctx.trainer)} completions are identical, their rewards equal, the "
            "advantages 0: the loss is 0 and nothing is learned. Sample (temperature around 1.0, top_k unset).",
            {"temperature": temperature, "top_k": top_k})
    if stack in PREFERENCE and getattr(args, "beta", None) == 0:
        return finding(
            "rl-constant-loss-settings", f"beta=0: the {stack.upper()} loss is constant",
            "beta scales the policy's log-ratio to the reference inside the loss; at 0 the loss is "
            f"{'-log(sigmoid(0)) = ln 2 = 0.6931' if stack == 'dpo' else 'the same'} for every pair and its "
            "gradient is 0. Use beta around 0.1.", {"beta": 0.0})
    return None


def _rows(ctx, count: int) -> list[dict[str, Any]]:
    data = getattr(ctx.trainer, "train_dataset", None)
    if data is None:
        return []
    try:
        return [dict(data[i]) for i in range(min(count, len(data)))]
    except Exception:  # an iterable dataset: nothing to read without consuming it
        return []


def _text(value: Any) -> str | None:
    """An answer as text: a string, or the content of a conversational answer's last message."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and isinstance(value[-1], dict):
        content = value[-1].get("content")
        return content if isinstance(content, str) else None
    return None


@rule("rl-completion-cap-short", "warning")
def completion_cap_short(ctx):
    """max_completion_length is shorter than most of the dataset's reference answers."""
    stack = trl_stack(ctx.trainer) if ctx.trainer is not None else None
    cap, tok = completion_cap(ctx.trainer) if stack in GENERATING else None, ctx.tokenizer
    if cap is None or tok is None:
        return None
    rows = _rows(ctx, SAMPLED_ROWS)
    column = next((c for c in ANSWER_COLUMNS if rows and c in rows[0]), None)
    texts = [t for t in (_text(r.get(column)) for r in rows) if t] if column else []
    if not texts:
        return None
    lengths = [len(tok(t, add_special_tokens=False)["input_ids"]) + 1 for t in texts]  # + the EOS that ends it
    median = statistics.median(lengths)
    if median <= cap:
        return None
    longer = sum(n > cap for n in lengths)
    return finding(
        "rl-completion-cap-short", f"max_completion_length={cap} is shorter than the answers ({median:g} tokens)",
        f"{longer} of {len(lengths)} reference answers in the '{column}' column are longer than "
        f"max_completion_length={cap} tokens (with their EOS). A completion that long is cut before its end and "
        "scored unfinished; when every completion is cut, the logged completions/clipped_ratio is 1.0. Raise "
        "max_completion_length above the answers' length.",
        {"max_completion_length": cap, "answer_column": column, "answer_tokens": lengths, "median": median})


def _completions(ctx, prompts: list[Any]) -> tuple[list[Any], list[Any], list[list[int]]]:
    """A few real completions of ``prompts`` by the trainer's model, generated the way TRL samples
    (``CHECK_PER_PROMPT`` each, ``CHECK_TOKENS`` new tokens at most), with every RNG put back."""
    model, tok = ctx.trainer.model, ctx.tokenizer
    args = _args(ctx)
    device = next(model.parameters()).device
    chat = isinstance(prompts[0], list)
    texts = [tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True) if chat else p for p in prompts]
    cap = min(completion_cap(ctx.trainer) or CHECK_TOKENS, CHECK_TOKENS)
    out_prompts, completions, ids = [], [], []
    with preserved_rng(), torch.no_grad(), in_eval_mode(model):
        for prompt, text in zip(prompts, texts):
            enc = tok(text, return_tensors="pt", add_special_tokens=False).to(device)
            gen = model.generate(**enc, max_new_tokens=cap, do_sample=True, num_return_sequences=CHECK_PER_PROMPT,
                                 temperature=float(getattr(args, "temperature", 1.0) or 1.0),
                                 pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
            for row in gen[:, enc["input_ids"].shape[1]:].tolist():
                if tok.eos_token_id in row:
                    row = row[:row.index(tok.eos_token_id) + 1]
                decoded = tok.decode(row, skip_special_tokens=True)
                out_prompts.append(prompt)
                completions.append([{"role": "assistant", "content": decoded}] if chat else decoded)
                ids.append(row)
    return out_prompts, completions, ids


def _noop(*args: Any, **kwargs: Any) -> None:
    """TRL passes ``log_extra`` and ``log_metric`` to every reward function; here they log nothing."""


@rule("rl-reward-function-broken", "error")
def reward_function_broken(ctx):
    """A reward function raises, returns the wrong number of rewards, or non-finite rewards on real completions."""
    if ctx.trainer is None or trl_stack(ctx.trainer) not in GENERATING or ctx.tokenizer is None:
        return None
    funcs = plain_reward_functions(ctx.trainer)
    rows = [r for r in _rows(ctx, CHECK_PROMPTS) if "prompt" in r]
    if not funcs or not rows:
        return None
    prompts, completions, ids = _completions(ctx, [r["prompt"] for r in rows])
    repeated = [r for r in rows for _ in range(CHECK_PER_PROMPT)]
    columns = {k: [r[k] for r in repeated] for k in rows[0] if k not in ("prompt", "completion", "completion_ids")}
    found = []
    for _, name, func in funcs:
        evidence: dict[str, Any] = {"reward_function": name, "completions": len(completions),
                                    "example_completion": completions[0]}
        try:
            out = func(prompts=prompts, completions=completions, completion_ids=ids, **columns,
                       trainer_state=getattr(ctx.trainer, "state", None), log_extra=_noop, log_metric=_noop)
        except Exception as exc:
            evidence["exception"] = f"{type(exc).__name__}: {exc}"
            found.append(finding("rl-reward-function-broken", f"reward function {name!r} raises on real completions",
                                 f"Called once as TRL calls it, on {len(completions)} completions the model generated "
                                 f"for the dataset's first prompts, {name!r} raised {type(exc).__name__}: {exc}. "
                                 "Training would stop at its first generation.", evidence))
            continue
        values = list(out) if hasattr(out, "__len__") else None
        if values is None or len(values) != len(completions):
            evidence["returned"] = len(values) if values is not None else type(out).__name__
            found.append(finding("rl-reward-function-broken", f"reward function {name!r} returns the wrong number of "
                                 "rewards", f"TRL needs one reward per completion: {name!r} returned "
                                 f"{evidence['returned']} for {len(completions)} completions, and GRPOTrainer raises "
                                 "ValueError at its first generation.", evidence))
            continue
        bad = [i for i, v in enumerate(values) if v is not None and not math.isfinite(float(v))]
        if bad:
            evidence.update(values=[None if v is None else float(v) for v in values],
                            example_completion=completions[bad[0]])
            found.append(finding("rl-reward-function-broken", f"reward function {name!r} returns non-finite rewards",
                                 f"On {len(bad)} of {len(completions)} real completions {name!r} returned "
                                 f"{float(values[bad[0]])!r}. A non-finite reward makes the group's advantages NaN "
                                 "or flat: loss 0, gradient 0, no error. Return a finite penalty (or None, which "
                                 "TRL leaves out) instead.", evidence, fixes=["finite-rewards"], severity="warning"))
    return found or None


def _sampling(args: Any) -> dict[str, Any]:
    """The sampler's truncation settings as vLLM sees them: the config's, overridden by ``generation_kwargs``."""
    out = {k: getattr(args, k, None) for k in ("top_p", "top_k", "min_p")}
    extra = getattr(args, "generation_kwargs", None)
    if isinstance(extra, dict):
        out.update({k: extra[k] for k in out if k in extra})
    return out


def _kept_by(top_p: Any, top_k: Any, min_p: Any) -> list[str]:
    truncating = []
    if isinstance(top_p, (int, float)) and top_p < 1.0:
        truncating.append(f"top_p={top_p:g}")
    if isinstance(top_k, int) and top_k > 0:
        truncating.append(f"top_k={top_k}")
    if isinstance(min_p, (int, float)) and min_p > 0:
        truncating.append(f"min_p={min_p:g}")
    return truncating


@rule("rl-vllm-truncated-sampling", "warning")
def vllm_truncated_sampling(ctx):
    """GRPO with vLLM and top_p < 1, top_k > 0 or min_p > 0: the importance ratio is scaled by the kept mass."""
    args = _args(ctx)
    stack = trl_stack(ctx.trainer) if ctx.trainer is not None else config_stack(args)
    if stack != "grpo" or args is None or getattr(args, "use_vllm", False) is not True:
        return None
    correction = getattr(args, "vllm_importance_sampling_correction", False) is True
    mask = getattr(args, "off_policy_mask_threshold", None) is not None
    if not (correction or mask):  # nothing reads vLLM's log-probabilities
        return None
    settings = _sampling(args)
    truncating = _kept_by(**settings)
    if not truncating:
        return None
    users = " and ".join(u for u, on in (("the importance-sampling correction", correction),
                                           ("the off-policy mask", mask)) if on)
    return finding(
        "rl-vllm-truncated-sampling", f"vLLM samples with {', '.join(truncating)}: the importance ratio is biased",
        f"With use_vllm, GRPO divides the trainer's token probabilities (a full-vocabulary softmax of logits / "
        f"temperature) by vLLM's, which {', '.join(truncating)} renormalises over the tokens it kept: every "
        f"token's ratio is multiplied by the probability mass the truncation kept (at most top_p; often far "
        f"less with top_k), whatever the policy did, and {users} act on that "
        "biased ratio (trl#6789). Sample from the full distribution (top_p=1.0, top_k=0, min_p=None), or turn "
        "vllm_importance_sampling_correction off.",
        {**settings, "use_vllm": True, "vllm_importance_sampling_correction": correction,
         "off_policy_mask_threshold": getattr(args, "off_policy_mask_threshold", None),
         "vllm_mode": getattr(args, "vllm_mode", None)}, fixes=["full-vocabulary-sampling"])
