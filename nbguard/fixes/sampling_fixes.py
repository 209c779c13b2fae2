"""match-sampling-settings: GRPO samples from the distribution its log-probabilities score.

TRL scores completions with a full-vocabulary softmax at the config's temperature; the sampler applies
the config's top_p/top_k/min_p/repetition_penalty as well, and ``generation_kwargs`` over all of them.
The fix leaves the config's temperature (what the trainer scores with) as the one setting of both sides.
"""
from __future__ import annotations

from ..introspect.trl_sampling import SAMPLING_KEYS
from .registry import Fix, register
from .rl_fixes import REBUILD, neutral_sampling

NEUTRAL = {"top_p": 1.0, "top_k": 0, "min_p": None, "repetition_penalty": 1.0}  # GRPOConfig's defaults


def _match(target, **_):
    args = target.args
    if not isinstance(getattr(args, "temperature", None), (int, float)) or not hasattr(args, "generation_kwargs"):
        raise ValueError("fix 'match-sampling-settings' needs a TRL GRPOConfig (a numeric temperature and "
                         f"generation_kwargs); got {type(args).__name__}")
    return neutral_sampling(args, NEUTRAL, SAMPLING_KEYS, note=f" ({REBUILD})")


def _match_code(names, **_):
    a = names.args
    return f"""# GRPO's log-probabilities are a full-vocabulary softmax at {a}.temperature; a sampler that applies
# another temperature (generation_kwargs), truncation (top_p/top_k/min_p) or a repetition penalty draws
# the completions from another distribution than the one trained. Let the config's temperature rule both
# sides; build the trainer again from these args.
{a}.top_p, {a}.top_k, {a}.min_p, {a}.repetition_penalty = 1.0, 0, None, 1.0
if {a}.generation_kwargs:
    {a}.generation_kwargs = {{k: v for k, v in {a}.generation_kwargs.items() if k not in {SAMPLING_KEYS!r}}}
"""


register(Fix("match-sampling-settings", "Sample from the distribution the trainer scores",
             "Drop temperature, top_p, top_k, min_p and repetition_penalty from generation_kwargs and set the "
             "config's truncation and penalty to none, so the completions are samples of the distribution GRPO's "
             "log-probabilities score.", _match, _match_code, needs="args"))
