"""Fixes for runs that stop learning without a NaN: a learning-rate warmup, finite rewards for
TRL's GRPO/RLOO reward functions, dropout off, and a hotter sampler or an entropy bonus for a policy
that collapsed."""
from __future__ import annotations

import functools
import inspect
import math
from typing import Any

from ..introspect.trl import TAPPED, plain_reward_functions
from .registry import Fix, register


# ---- add-warmup ------------------------------------------------------------------------------
def _check_ratio(ratio: Any) -> float:
    if not (isinstance(ratio, (int, float)) and 0 < ratio < 1):
        raise ValueError(f"ratio must be a fraction of the training steps between 0 and 1; got {ratio!r}")
    return float(ratio)


def _warmup(target, ratio: float = 0.1, **_):
    ratio = _check_ratio(ratio)
    old = getattr(target.args, "warmup_steps", 0) or 0
    if old:  # a warmup is already there: keep the user's
        return {}
    target.args.warmup_steps = ratio  # below 1: a fraction of the training steps (the scheduler is rebuilt by train())
    return {"args.warmup_steps": f"{old} -> {ratio}"}


def _warmup_code(names, ratio: float = 0.1, **_):
    ratio = _check_ratio(ratio)
    return f"""# Warm the learning rate up over the first {ratio:.0%} of the steps: the first updates, taken while
# AdamW's second moments are still tiny, no longer move the weights by a full learning rate each.
# train() builds its scheduler from the args again, so this takes effect at the next train().
{names.args}.warmup_steps = {ratio!r}
"""


register(Fix("add-warmup", "Warm the learning rate up",
             "Set args.warmup_steps to a fraction (default 0.1) of the training steps when there is no warmup.",
             _warmup, _warmup_code, needs="args"))


# ---- finite-rewards --------------------------------------------------------------------------
# The fix's cell carries this function's own source: apply wraps with it too.
def finite_rewards(func, floor=None):
    """``func`` with every inf/-inf/NaN reward replaced by ``floor`` (None: TRL leaves that completion
    out of the function's mean)."""
    @functools.wraps(func)
    def reward(*args, **kwargs):
        return [v if v is None or math.isfinite(v) else floor for v in func(*args, **kwargs)]

    reward.__nbguard_finite__ = True  # wrapped once: running the fix again leaves it
    return reward


def _check_floor(floor: Any) -> float | None:
    if floor is not None and not (isinstance(floor, (int, float)) and math.isfinite(floor)):
        raise ValueError(f"floor must be a finite number or None; got {floor!r}")
    return floor


def _finite(target, floor: float | None = None, **_):
    floor = _check_floor(floor)
    funcs = getattr(target.trainer, "reward_funcs", None)
    if not isinstance(funcs, list):
        raise ValueError("fix 'finite-rewards' needs a TRL trainer with reward functions (GRPOTrainer, RLOOTrainer)")
    changed = {}
    for i, name, func in plain_reward_functions(target.trainer):
        # a watch's tap (which sees what the function returns) stays outermost: the fix goes inside it
        holder, inner = (func, getattr(func, TAPPED)) if hasattr(func, TAPPED) else (None, func)
        if getattr(inner, "__nbguard_finite__", False):
            continue
        if holder is not None:
            setattr(holder, TAPPED, finite_rewards(inner, floor))
        else:
            funcs[i] = finite_rewards(inner, floor)
        changed[f"reward_funcs[{i}]"] = f"{name}: non-finite rewards -> {floor!r}"
    return changed


def _finite_code(names, floor: float | None = None, **_):
    floor = _check_floor(floor)
    t = names.trainer
    return f"""# A reward function that returns inf/-inf/NaN (a log-score of no match) makes the group's advantages
# NaN or flat: loss 0, gradient 0, no error. Replace non-finite rewards by {floor!r}
# (None: TRL leaves that completion out of the function's mean).
import functools
import math

import torch


{inspect.getsource(finite_rewards)}

{t}.reward_funcs = [f if isinstance(f, torch.nn.Module) or getattr(f, "__nbguard_finite__", False)
                   else finite_rewards(f, {floor!r}) for f in {t}.reward_funcs]
"""


register(Fix("finite-rewards", "Replace non-finite rewards",
             "Wrap each GRPO/RLOO reward function so inf/-inf/NaN rewards become floor (default None: left out).",
             _finite, _finite_code, needs="trainer"))


# ---- disable-dropout -------------------------------------------------------------------------
def _no_dropout(target, **_):
    import torch

    changed = {}
    for name, module in target.model.named_modules():
        if isinstance(module, torch.nn.Dropout) and module.p > 0:
            changed[f"{name}.p"] = f"{module.p} -> 0"
            module.p = 0.0
        # attention layers keep their dropout as a float attribute, which TRL's disable_dropout misses
        p = getattr(module, "attention_dropout", None)
        if isinstance(p, float) and p > 0:
            changed[f"{name}.attention_dropout"] = f"{p} -> 0"
            module.attention_dropout = 0.0
    config = getattr(target.model, "config", None)
    for key in ("attention_dropout", "hidden_dropout", "dropout"):
        value = getattr(config, key, None)
        if isinstance(value, float) and value > 0:
            setattr(config, key, 0.0)
            changed[f"config.{key}"] = f"{value} -> 0"
    return changed


def _no_dropout_code(names, **_):
    m = names.model
    return f"""# RL fine-tuning compares the policy with itself (old/new log-probabilities, or generation vs training):
# dropout makes two forwards of the same weights differ. Turn it off everywhere, attention included.
import torch

for _module in {m}.modules():
    if isinstance(_module, torch.nn.Dropout):
        _module.p = 0.0
    if isinstance(getattr(_module, "attention_dropout", None), float):
        _module.attention_dropout = 0.0
for _key in ("attention_dropout", "hidden_dropout", "dropout"):
    if isinstance(getattr({m}.config, _key, None), float):
        setattr({m}.config, _key, 0.0)
"""


register(Fix("disable-dropout", "Turn dropout off",
             "Set every nn.Dropout's p and every attention layer's attention_dropout (and the config's) to 0.",
             _no_dropout, _no_dropout_code, needs="model"))


# ---- raise-temperature / add-entropy-bonus ---------------------------------------------------
# GRPO/RLOO read these settings when the trainer is built (the sampler's generation config, the fused
# head's temperature, the entropy bonus): the fixes change the args, and the trainer built from them again
# samples and learns with the new values (the policy keeps the weights it has).
REBUILD = "takes effect when the trainer is built again from these args"


def neutral_sampling(args: Any, neutral: dict[str, Any], keys: tuple[str, ...], note: str = "") -> dict[str, str]:
    """Set ``args``' sampling settings to ``neutral`` and drop ``keys`` from its ``generation_kwargs``
    (where the sampler reads them over the config's); returns what changed. ``generation_kwargs`` gets a new
    dict, not the user's emptied in place: a verification applies a fix to a shallow copy of the args."""
    changed = {}
    for key, value in neutral.items():
        old = getattr(args, key, None)
        if old != value:
            setattr(args, key, value)
            changed[f"args.{key}"] = f"{old} -> {value} ({REBUILD})"
    extra = getattr(args, "generation_kwargs", None)
    if isinstance(extra, dict) and any(key in extra for key in keys):
        for key in keys:
            if key in extra:
                changed[f"args.generation_kwargs[{key!r}]"] = f"{extra[key]} -> removed{note}"
        args.generation_kwargs = {k: v for k, v in extra.items() if k not in keys}
    return changed


def _check_positive(name: str, value: Any, upper: float) -> float:
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= upper):
        raise ValueError(f"{name} must be a number in (0, {upper:g}]; got {value!r}")
    return float(value)


def _rl_args(target, fix_id: str, field: str):
    args = target.args
    if not isinstance(getattr(args, field, None), (int, float)):
        raise ValueError(f"fix {fix_id!r} needs a TRL GRPOConfig/RLOOConfig with a numeric {field!r} "
                         f"(got {type(args).__name__})")
    return args


def _raise_temperature(target, temperature: float = 1.2, **_):
    temperature = _check_positive("temperature", temperature, 4.0)
    args = _rl_args(target, "raise-temperature", "temperature")
    old = args.temperature
    if old >= temperature:  # already as hot: keep the user's
        return {}
    args.temperature = temperature
    return {"args.temperature": f"{old} -> {temperature} ({REBUILD})"}


def _raise_temperature_code(names, temperature: float = 1.2, **_):
    temperature = _check_positive("temperature", temperature, 4.0)
    return f"""# Sample hotter, so a prompt's completions differ and their rewards can teach: the policy narrowed onto a
# few answers (entropy or completion length collapsed), or sampling too cold gave every group equal rewards.
# GRPOTrainer/RLOOTrainer read the temperature when they are built: build the trainer again from these
# args (pass it the same model: the policy keeps its weights). The logged `entropy` rises at once.
{names.args}.temperature = max({names.args}.temperature, {temperature!r})
"""


register(Fix("raise-temperature", "Sample at a higher temperature",
             "Raise the GRPO/RLOO sampling temperature (default 1.2) in the args the trainer is built from.",
             _raise_temperature, _raise_temperature_code, needs="args"))


def _entropy_bonus(target, coef: float = 0.01, **_):
    coef = _check_positive("coef", coef, 1.0)
    args = _rl_args(target, "add-entropy-bonus", "entropy_coef")
    old = args.entropy_coef
    if old >= coef:
        return {}
    args.entropy_coef = coef
    return {"args.entropy_coef": f"{old} -> {coef} ({REBUILD})"}


def _entropy_bonus_code(names, coef: float = 0.01, **_):
    coef = _check_positive("coef", coef, 1.0)
    return f"""# The policy's entropy collapsed while its reward stayed flat: add TRL's entropy bonus to the GRPO loss
# (loss - entropy_coef * mean token entropy), which keeps the policy from turning near-deterministic.
# GRPOTrainer reads entropy_coef when it is built: build the trainer again from these args (pass it the
# same model). The trainer then logs `entropy_coef` every step.
{names.args}.entropy_coef = max({names.args}.entropy_coef, {coef!r})
"""


register(Fix("add-entropy-bonus", "Add an entropy bonus",
             "Set GRPOConfig's entropy_coef (default 0.01) so the loss rewards entropy and the policy keeps sampling.",
             _entropy_bonus, _entropy_bonus_code, needs="args"))


# ---- lower-beta -------------------------------------------------------------------------------
def _lower_beta(target, beta: float = 0.01, **_):
    beta = _check_positive("beta", beta, 10.0)
    args = _rl_args(target, "lower-beta", "beta")
    old = args.beta
    if old <= beta:  # already as low: keep the user's
        return {}
    args.beta = beta
    return {"args.beta": f"{old} -> {beta} ({REBUILD})"}


def _lower_beta_code(names, beta: float = 0.01, **_):
    beta = _check_positive("beta", beta, 10.0)
    return f"""# The preference loss is ~0 from the first step: beta x (the policy's log-ratio margin to its reference)
# is so large that the sigmoid is saturated and the gradient vanishes (a reference far from the policy, or
# beta too large). A smaller beta brings the loss back where it has a gradient; a reference made from the
# policy's own starting weights is the other cure. DPOTrainer/KTOTrainer read beta when they are built:
# build the trainer again from these args (pass it the same model and reference).
{names.args}.beta = min({names.args}.beta, {beta!r})
"""


register(Fix("lower-beta", "Lower the preference beta",
             "Set DPOConfig/KTOConfig's beta (default 0.01) so beta x the log-ratio margin no longer saturates the loss.",
             _lower_beta, _lower_beta_code, needs="args"))


# ---- full-vocabulary-sampling ----------------------------------------------------------------
TRUNCATION = {"top_p": 1.0, "top_k": 0, "min_p": None}  # GRPOConfig's defaults: nothing cut from the distribution


def _full_vocabulary(target, **_):
    args = _rl_args(target, "full-vocabulary-sampling", "top_p")
    return neutral_sampling(args, TRUNCATION, tuple(TRUNCATION))


def _full_vocabulary_code(names, **_):
    a = names.args
    return f"""# vLLM's log-probabilities under top_p/top_k/min_p are renormalised over the tokens it kept, the
# trainer's are over the whole vocabulary: their ratio (the importance-sampling correction) is scaled by
# the kept mass whatever the policy did. Sample from the full distribution; build the trainer again from
# these args.
{a}.top_p, {a}.top_k, {a}.min_p = 1.0, 0, None
if {a}.generation_kwargs:
    {a}.generation_kwargs = {{k: v for k, v in {a}.generation_kwargs.items() if k not in ("top_p", "top_k", "min_p")}}
"""


register(Fix("full-vocabulary-sampling", "Sample from the full distribution",
             "Set top_p=1.0, top_k=0 and min_p=None (and drop them from generation_kwargs) so vLLM's "
             "log-probabilities match the trainer's.", _full_vocabulary, _full_vocabulary_code, needs="args"))
