"""What GRPO samples from against what it scores: the two distributions of one rollout, read off the
trainer (or its config) without importing TRL.

GRPO's loss treats each completion as a sample of the policy its log-probabilities score. TRL scores
with a full-vocabulary softmax of the logits divided by the temperature it was built with; the
sampler (transformers' ``generate`` with the trainer's ``generation_config``, or vLLM with the
config's settings) applies its own temperature, truncation (top_p, top_k, min_p) and repetition
penalty, overridden by ``generation_kwargs``. Every setting that is on the sampler's side only makes
the completions samples of another distribution than the one trained (trl#4159, trl#6789).
The audit names them from here; the watch names them as the cause of what it measured.
"""
from __future__ import annotations

from typing import Any

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def sampler_settings(trainer: Any = None, args: Any = None) -> dict[str, Any]:
    """The settings the generation engine samples with: the config's, with ``generation_kwargs`` over
    them, as GRPOTrainer builds transformers' ``generation_config`` and vLLM's sampling parameters from
    them (read from the args, so a fix to the args shows in a re-audit of the trainer as built)."""
    args = args if args is not None else getattr(trainer, "args", None)
    out = {k: getattr(args, k, None) for k in SAMPLING_KEYS}
    out["do_sample"] = True  # TRL always samples
    extra = getattr(args, "generation_kwargs", None)
    if isinstance(extra, dict):
        out.update({k: extra[k] for k in (*SAMPLING_KEYS, "do_sample") if k in extra})
    return out


def scoring_temperature(trainer: Any = None, args: Any = None) -> float | None:
    """The temperature the trainer's log-probabilities divide the logits by: the trainer's own
    (read when it was built), else the config's."""
    value = _number(getattr(trainer, "temperature", None)) if trainer is not None else None
    if value is None:
        value = _number(getattr(args if args is not None else getattr(trainer, "args", None), "temperature", None))
    return value


def one_sided_settings(sampler: dict[str, Any], temperature: float | None) -> dict[str, Any]:
    """The sampler's settings the trainer's log-probabilities do not apply: ``{key: (sampler's, trainer's)}``.
    The trainer applies only its temperature, over the whole vocabulary, with no penalty."""
    out: dict[str, Any] = {}
    sampled_t = _number(sampler.get("temperature"))
    if sampled_t is not None and temperature is not None and abs(sampled_t - temperature) > 1e-6 * temperature:
        out["temperature"] = (sampled_t, temperature)
    top_p, top_k, min_p = (_number(sampler.get(k)) for k in ("top_p", "top_k", "min_p"))
    if top_p is not None and top_p < 1.0:
        out["top_p"] = (top_p, 1.0)
    if top_k is not None and top_k > 0:
        out["top_k"] = (int(top_k), "the whole vocabulary")
    if min_p is not None and min_p > 0:
        out["min_p"] = (min_p, 0.0)
    penalty = _number(sampler.get("repetition_penalty"))
    if penalty is not None and penalty != 1.0:
        out["repetition_penalty"] = (penalty, 1.0)
    if sampler.get("do_sample") is False:
        out["do_sample"] = (False, True)
    return out


def describe(settings: dict[str, Any]) -> str:
    """``temperature 0.5 (trainer 1.0), top_p 0.9 (trainer 1.0)``: the one-sided settings in words."""
    return ", ".join(f"{k} {s} (trainer {t})" for k, (s, t) in settings.items())
