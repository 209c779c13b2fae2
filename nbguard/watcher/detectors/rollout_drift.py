"""GRPO trained on tokens that were not sampled from the distribution its log-probabilities score.

The policy gradient assumes each completion is a sample of the policy whose log-probabilities the loss
uses. A sampler whose settings differ from the trainer's (a ``generation_kwargs`` temperature the
trainer's log-probabilities never see, top_p/top_k/min_p or a repetition penalty on the sampler's side
only: trl#4159, trl#6789), or vLLM's numbers drifting from the trainer's (trl#3867), breaks that with no
NaN and no error: the run trains on biased gradients.

Three readings, one event kind:

- **Sampled tokens against the trainer's own distribution** (any generation engine, vLLM or not). For a
  token drawn from the trainer's distribution p, ``-log p(token)`` has expectation ``H(p)``, the entropy
  TRL computes beside it; ``g = -log p(token) - H(p)`` is 0 on average, token after token. Tokens drawn
  from a sharper sampler (a lower temperature, truncation) are likelier than typical (``g < 0``); from a
  flatter one, less likely (``g > 0``). The watch sums g and g² over the completion tokens (tool output
  masked out, as TRL masks it) of every micro-batch scored before any optimizer step since its
  generation (later ones are off-policy by design), and judges ``z = Σg / sqrt(Σg²)``: the sum over its
  own spread, learned from the run's tokens. A run whose sampler is its trainer's keeps |z| small
  whatever its entropy; a one-sided setting moves z by about the square root of the tokens seen.
- **TRL's own ``sampling/*`` metrics** (vLLM with ``vllm_importance_sampling_correction``): the mean
  |log-prob difference| between vLLM and the trainer, judged against its own early level and the
  log-to-log noise of it (log scale): a rise far outside that noise is drift (weights not synced,
  stale async rollouts, a kernel that changed). TRL logs the importance-sampling ratio after clipping
  (trl#5231), so the ratio's min/max ride along as evidence, not as the judge.
- **The ids a custom ``rollout_func`` returns against its sampled log-probabilities**: a row with more
  or fewer ids than log-probabilities was rebuilt after sampling (decoded and rendered again), so the
  trainer trains on tokens that were never sampled (multi-turn and tool pipelines that re-render).

The sums stay on the device and are read once per logged step, at the log: with ``logging_steps=1``
that is one read per step, beside the dozen TRL itself makes per micro-batch for its metrics.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

import torch

from ...document.model import register_event_kind
from ...introspect.trl_sampling import describe, one_sided_settings, sampler_settings, scoring_temperature
from ..integrations.instance_wrap import Patch, patch

KIND = "rollout-logprob-mismatch"
register_event_kind(KIND, "GRPO trains on tokens that were not sampled from the distribution its log-probabilities "
                          "score (sampler and trainer settings differ, vLLM's log-probabilities drift, or a "
                          "rollout's ids are not the sampled ones)",
                    ("reason", "z", "gap_per_token", "tokens", "one_sided_settings", "difference_now", "rows"))

Found = tuple[str, str, dict[str, Any]]
DIFFERENCE = "sampling/sampling_logp_difference/mean"
RATIO_KEYS = ("sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean",
              "sampling/importance_sampling_ratio/max")


@dataclass
class RolloutDriftSettings:
    z: float = 5.0  # |Σg| over this many of its own standard deviations: not a healthy sampler's noise
    window: int = 3  # logs in the early level and in the recent level of TRL's logged difference
    sigmas: float = 6.0  # the recent level this many log-scale noises above the early level: drift

    @property
    def min_tokens(self) -> float:
        # |Σg| / sqrt(Σg²) is at most sqrt(tokens), so z is out of reach below z² tokens; judging from
        # twice that keeps a handful of extreme tokens from deciding alone
        return 2 * self.z ** 2


def finite_number(value: Any) -> float | None:
    """A logged value as a finite float; None where it is missing, not a number, or not finite."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


class SampledTokenCheck:
    """Taps GRPOTrainer's generation, loss and log-prob methods (``instance_wrap.patch``; the results go
    back untouched) and keeps Σg, Σg² and the token count on the device."""

    def __init__(self, trainer: Any, on_error, settings: RolloutDriftSettings):
        self.trainer = trainer
        self.settings = settings
        self.on_error = on_error
        self.generated_at: int | None = None  # the optimizer step of the last generation
        self.mask: Any = None  # the loss's token mask while TRL's _compute_loss runs
        self.stats: Any = None  # tensor [Σg, Σg², tokens] on the device
        self.patches: list[Patch] = []
        self.reported = False

    def bind(self) -> None:
        names = ("_generate_and_score_completions", "_compute_loss", "_get_per_token_logps_and_entropies")
        if self.patches or not all(callable(getattr(self.trainer, n, None)) for n in names):
            return
        self.patches = [patch(self.trainer, names[0], self._generated, self.on_error),
                        patch(self.trainer, names[1], self._loss, self.on_error),
                        patch(self.trainer, names[2], self._scored, self.on_error)]

    def unbind(self) -> None:
        for held in self.patches:
            held.remove()
        self.patches = []

    def _step(self) -> int | None:
        step = getattr(getattr(self.trainer, "state", None), "global_step", None)
        return step if isinstance(step, int) else None

    def _generated(self, call, *args: Any, **kwargs: Any) -> Any:
        out = call(*args, **kwargs)
        self.generated_at = self._step()
        return out

    def _loss(self, call, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        mask = inputs.get("completion_mask") if isinstance(inputs, dict) else None
        if mask is not None and inputs.get("tool_mask") is not None:
            mask = mask * inputs["tool_mask"]  # tool output is not sampled: TRL masks it out of the loss too
        self.mask = mask
        try:
            return call(model, inputs, *args, **kwargs)
        finally:
            self.mask = None

    def _scored(self, call, *args: Any, **kwargs: Any) -> Any:
        out = call(*args, **kwargs)
        mask = self.mask
        model = getattr(self.trainer, "model", None)
        fresh = self.generated_at is not None and self.generated_at == self._step()
        if mask is None or not fresh or not kwargs.get("compute_entropy") or not getattr(model, "training", False):
            return out
        logps, entropies = out[0], out[1]
        if entropies is None or logps.shape != mask.shape or entropies.shape != mask.shape:
            return out
        with torch.no_grad():
            gap = -logps.detach().to(torch.float64) - entropies.detach().to(torch.float64)
            # a non-finite token is the NaN watch's to report; here it is left out, on the device (no read)
            finite = torch.isfinite(gap)
            weight = mask.to(torch.float64) * finite
            gap = torch.where(finite, gap, 0.0) * weight
            stats = torch.stack([gap.sum(), (gap * gap).sum(), weight.sum()])
        self.stats = stats if self.stats is None else self.stats + stats
        return out

    def on_log(self, step: int) -> list[Found]:
        if self.reported or self.stats is None:
            return []
        total, squares, tokens = self.stats.tolist()  # the one read, at the log
        if tokens < self.settings.min_tokens or not squares > 0 or not math.isfinite(total + squares):
            return []
        z = total / math.sqrt(squares)
        if abs(z) < self.settings.z:
            return []
        self.reported = True
        sampler = sampler_settings(self.trainer)
        temperature = scoring_temperature(self.trainer)
        one_sided = one_sided_settings(sampler, temperature)
        gap = total / tokens
        direction = ("likelier than the trainer's distribution gives them: the sampler is sharper (a lower "
                     "temperature, truncation)" if gap < 0 else "less likely than the trainer's distribution gives "
                     "them: the sampler is flatter (a higher temperature, a repetition penalty)")
        cause = (f"; the sampler applies {describe(one_sided)}, which the trainer's log-probabilities do not"
                 if one_sided else "; the settings agree, so the two computations differ (vLLM's numbers, "
                 "weights not synced to the sampler, dropout on in training)")
        evidence = {"reason": "sampled-tokens-atypical", "z": z, "gap_per_token": gap, "tokens": int(tokens),
                    "threshold_z": self.settings.z, "sampler": sampler, "scoring_temperature": temperature,
                    "one_sided_settings": {k: list(v) for k, v in one_sided.items()},
                    "use_vllm": bool(getattr(getattr(self.trainer, "args", None), "use_vllm", False)),
                    "fixes": fixes_for(one_sided)}
        return [(KIND, f"the sampled completion tokens are {direction} ({gap:+.3g} nats per token over "
                 f"{int(tokens)} tokens, {abs(z):.1f} standard deviations of their own spread): GRPO trains on "
                 f"samples of another distribution than the one its log-probabilities score{cause}", evidence)]


def fixes_for(one_sided: dict[str, Any]) -> list[str]:
    """A sampler setting the trainer does not apply: drop it from the sampler (the trainer's settings
    then rule both); truncation alone is also cleared by sampling the full vocabulary."""
    return ["match-sampling-settings"] if one_sided else []


class RolloutIdsCheck:
    """A custom ``rollout_func`` (TRL's experimental hook) returns the ids the trainer trains on and the
    sampler's log-probability of each token it sampled: a row with more or fewer ids than log-probabilities
    was rebuilt after sampling (decoded and rendered again: a dropped EOS, a re-tokenised turn), so the
    trainer trains on tokens that were never sampled. Lengths only, from the lists the rollout returned."""

    LISTED = 3  # rows named on the event

    def __init__(self, trainer: Any, on_error):
        self.trainer = trainer
        self.on_error = on_error
        self.held: Patch | None = None
        self.pending: list[Found] = []
        self.reported = False

    def bind(self) -> None:
        if self.held is None and callable(getattr(self.trainer, "rollout_func", None)):
            self.held = patch(self.trainer, "rollout_func", self._rollout, self.on_error)

    def unbind(self) -> None:
        if self.held is not None:
            self.held.remove()
            self.held = None

    def _rollout(self, call, *args: Any, **kwargs: Any) -> Any:
        out = call(*args, **kwargs)
        if self.reported or not isinstance(out, dict):
            return out
        ids, logprobs = out.get("completion_ids"), out.get("logprobs")
        if not isinstance(ids, list) or not isinstance(logprobs, list) or len(ids) != len(logprobs):
            return out  # no per-token log-probabilities to hold the ids against
        rows = [(i, len(a), len(b)) for i, (a, b) in enumerate(zip(ids, logprobs))
                if b is not None and len(a) != len(b)]
        if rows:
            self.reported = True
            evidence = {"reason": "trained-ids-not-sampled", "rows": len(rows), "completions": len(ids),
                        "examples": [{"row": i, "completion_ids": n, "logprobs": m} for i, n, m in rows[:self.LISTED]],
                        "fixes": []}
            i, n, m = rows[0]
            self.pending.append((KIND, f"rollout_func returned {n} completion ids but {m} sampled log-probabilities for "
                                 f"completion {i} ({len(rows)} of {len(ids)} rows differ): the ids the trainer trains "
                                 "on are not the ones that were sampled (decoding and rendering again is not "
                                 "reversible); return the sampled token ids themselves", evidence))
        return out

    def take(self) -> list[Found]:
        found, self.pending = self.pending, []
        return found


class LoggedDifferenceCheck:
    """TRL's ``sampling/sampling_logp_difference/mean`` rising far outside its own early noise."""

    def __init__(self, settings: RolloutDriftSettings):
        self.settings = settings
        self.series: list[tuple[int, float]] = []
        self.reported = False

    def on_log(self, step: int, logs: dict[str, Any]) -> list[Found]:
        value = finite_number(logs.get(DIFFERENCE))
        if self.reported or value is None or value <= 0:
            return []
        self.series.append((step, value))
        w = self.settings.window
        if len(self.series) < 2 * w:
            return []
        early = [math.log(v) for _, v in self.series[:w]]
        recent = [math.log(v) for _, v in self.series[-w:]]
        # the noise: the early logs' median log-to-log change (a floor of 1% keeps a constant series judgeable)
        noise = max(statistics.median(abs(b - a) for a, b in zip(early, early[1:])), math.log(1.01))
        level0, level1 = statistics.median(early), statistics.median(recent)
        if level1 - level0 < self.settings.sigmas * noise:
            return []
        self.reported = True
        ratio = {k.rsplit("/", 1)[1]: finite_number(logs.get(k)) for k in RATIO_KEYS}
        evidence = {"reason": "logprob-difference-rising", "difference_early": math.exp(level0),
                    "difference_now": math.exp(level1), "noise_log": noise, "sigmas": self.settings.sigmas,
                    "since_step": self.series[-w][0], "importance_sampling_ratio": ratio,
                    "ratio_logged_after_clipping": True, "fixes": []}
        return [(KIND, f"the mean |log-prob difference| between the sampler and the trainer rose from "
                 f"{math.exp(level0):.3g} to {math.exp(level1):.3g} ({(level1 - level0) / noise:.0f}x its early "
                 "log-to-log noise): the rollouts drift away from the policy being trained (weights not synced "
                 "to the sampler, stale asynchronous rollouts); TRL's importance-sampling ratio is logged after "
                 "clipping, so it hides how far", evidence)]


class RolloutDrift:
    """Both readings for one GRPOTrainer: bind/unbind its taps, judge at each log."""

    def __init__(self, trainer: Any, on_error, settings: RolloutDriftSettings | None = None):
        self.settings = settings or RolloutDriftSettings()
        self.sampled = SampledTokenCheck(trainer, on_error, self.settings)
        self.logged = LoggedDifferenceCheck(self.settings)
        self.ids = RolloutIdsCheck(trainer, on_error)

    def bind(self) -> None:
        self.sampled.bind()
        self.ids.bind()

    def unbind(self) -> None:
        self.sampled.unbind()
        self.ids.unbind()

    def on_log(self, step: int, logs: dict[str, Any]) -> list[Found]:
        return self.ids.take() + self.sampled.on_log(step) + self.logged.on_log(step, logs)
