"""What RL and preference runs get wrong without a NaN in the model: rewards and preference signals.

- a reward function that returns inf/-inf/NaN (a log-score of no match): GRPO's advantages turn
  NaN or flat, the loss 0, the gradient 0, and nothing in the model is non-finite;
- no learning signal: every group of completions of one prompt got the same reward (zero advantage,
  so loss 0 and gradient 0), or every completion was cut at ``max_completion_length``;
- no preference signal: DPO's margins stay exactly 0 (chosen identical to rejected, or a policy that
  never leaves its reference: the loss sits at ln 2 for ever), or the loss is already ~0 at the first
  step (a saturated sigmoid gives no gradient);
- the policy/old-policy ratio away from 1 on the first inner step (two forwards that differ);
- a collapse with no NaN: the policy's entropy falls to a small fraction of its early level, or its
  completions get half as long, while the reward does not improve (the policy narrows onto answers
  that are not better: verl#5953);
- a KL to the reference far from 0 at step 0, where the policy still is the reference
  (torchforge#664): the reference is not the initial policy. With ``beta=0`` TRL computes no KL (none
  is logged, or NaN in older releases: trl#4040); that is not judged at all.

The reward checks read what :class:`~nbguard.watcher.integrations.trl.RewardTap` saw; the preference,
ratio, collapse and reference checks read the trainer's own logged metrics. No device work.
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any

from ..integrations.trl import RewardCall, RewardTap
from .rollout_drift import RolloutDrift, finite_number

LN2 = math.log(2.0)
EXAMPLE_CHARS = 300  # an example completion in the evidence is cut to this many characters
WEIGHT_CHUNK = 1 << 22  # elements per chunk when the reference's weights are compared with the policy's


@dataclass
class RLSettings:
    flat_after: int = 3  # generations in a row whose every group's rewards are equal
    truncated_after: int = 3  # generations in a row whose every completion hit max_completion_length
    preference_flat_after: int = 3  # logged steps in a row with zero margins
    zero_loss: float = 1e-3  # a preference loss under this at the first log: the sigmoid is saturated
    collapse_window: int = 3  # logs in the early and in the recent window (medians over each)
    entropy_fraction: float = 0.2  # the recent entropy under this fraction of the early one: collapsed
    length_fraction: float = 0.5  # the recent mean completion length at or under this fraction: collapsed
    reward_gain: float = 0.5  # the reward improved when it rose by this many early within-group stds
    kl_at_start: float = 1e-3  # a KL above this on step 0, where the policy is the reference


Found = tuple[str, str, dict[str, Any]]  # (event kind, message, evidence)


def _finite(values: list[float | None]) -> list[float]:
    return [v for v in values if v is not None and math.isfinite(v)]


def _example(completion: Any) -> str:
    text = completion if isinstance(completion, str) else repr(completion)
    return text if len(text) <= EXAMPLE_CHARS else text[:EXAMPLE_CHARS] + "..."


class RewardChecks:
    """Non-finite rewards, flat groups and truncated completions, from each reward function's call."""

    def __init__(self, group_size: int | None, max_completion_length: int | None, eos_token_id: int | None,
                 settings: RLSettings | None = None):
        self.settings = settings or RLSettings()
        self.group_size = group_size if isinstance(group_size, int) and group_size > 1 else None
        self.max_completion_length = max_completion_length
        self.eos_token_id = eos_token_id
        self.nonfinite: dict[str, dict[str, Any]] = {}  # function name -> the evidence of its event
        self.flat_streak: dict[str, int] = {}
        self.truncated_streak = 0
        self.first_name: str | None = None  # completions are the same for every function: count them once
        self.reported: set[str] = set()

    def observe(self, call: RewardCall, step: int) -> list[Found]:
        found: list[Found] = []
        nonfinite = self._nonfinite(call, step)
        if nonfinite is not None:
            found.append(nonfinite)
        flat = self._flat(call)
        if flat is not None:
            found.append(flat)
        if self.first_name is None:
            self.first_name = call.name
        if call.name == self.first_name:
            truncated = self._truncated(call)
            if truncated is not None:
                found.append(truncated)
        return found

    def _nonfinite(self, call: RewardCall, step: int) -> Found | None:
        bad = [i for i, v in enumerate(call.values) if v is not None and not math.isfinite(v)]
        if not bad:
            return None
        known = self.nonfinite.get(call.name)
        if known is not None:  # one event per function; later calls are counted on it
            known["calls_with_nonfinite"] += 1
            known["last_step"] = step
            return None
        # the example: a bad completion with some text, when there is one (an empty answer explains little)
        first = next((i for i in bad if i < len(call.completions) and call.completions[i]), bad[0])
        evidence = {"reward_function": call.name, "nonfinite_rewards": len(bad), "rewards_returned": len(call.values),
                    "value": call.values[first], "example_index": first,
                    "example_completion": _example(call.completions[first]) if first < len(call.completions) else None,
                    "calls_with_nonfinite": 1, "first_step": step, "last_step": step}
        self.nonfinite[call.name] = evidence
        return ("nonfinite-reward", f"reward function {call.name!r} returned {call.values[first]!r} for "
                f"{len(bad)} of {len(call.values)} completions: the advantages are no longer finite, so the "
                f"run learns nothing from this generation", evidence)

    def _flat(self, call: RewardCall) -> Found | None:
        """Every group's (one prompt's completions') rewards equal: zero advantage everywhere."""
        size = self.group_size
        values = call.values
        if size is None or not values or len(values) % size or len(_finite(values)) < len(values):
            self.flat_streak[call.name] = 0  # unknown grouping, or non-finite: another check's business
            return None
        groups = [values[i:i + size] for i in range(0, len(values), size)]
        flat = all(max(g) == min(g) for g in groups)  # type: ignore[type-var]  # all finite floats here
        self.flat_streak[call.name] = self.flat_streak.get(call.name, 0) + 1 if flat else 0
        streak = min(self.flat_streak.values())
        if streak < self.settings.flat_after or "flat" in self.reported:
            return None
        self.reported.add("flat")
        evidence = {"reason": "equal-rewards-in-every-group", "generations": streak, "group_size": size,
                    "groups": len(groups), "reward_functions": sorted(self.flat_streak),
                    "rewards": values[:16]}
        return ("no-learning-signal", f"every group's {size} completions got the same reward for {streak} "
                f"generations in a row: the advantages are 0, so the loss and the gradient are 0", evidence)

    def _truncated(self, call: RewardCall) -> Found | None:
        cap, ids = self.max_completion_length, call.completion_ids
        if not cap or not ids:
            return None
        cut = all(len(row) >= cap and (not row or row[-1] != self.eos_token_id) for row in ids)
        self.truncated_streak = self.truncated_streak + 1 if cut else 0
        if self.truncated_streak < self.settings.truncated_after or "truncated" in self.reported:
            return None
        self.reported.add("truncated")
        evidence = {"reason": "every-completion-truncated", "generations": self.truncated_streak,
                    "max_completion_length": cap, "completions": len(ids),
                    "example_completion": _example(call.completions[0]) if call.completions else None}
        return ("completions-truncated", f"every completion of the last {self.truncated_streak} generations was "
                f"cut at max_completion_length={cap} before its end: rewards score unfinished answers", evidence)


class LoggedFlatness:
    """Equal rewards in every group, read from the log (``frac_reward_zero_std``): the way to see it
    when a reward is a model (``nn.Module``), whose outputs the tap does not see."""

    def __init__(self, settings: RLSettings | None = None):
        self.settings = settings or RLSettings()
        self.flat: list[int] = []  # the logged steps of the current flat stretch
        self.reported = False

    def on_log(self, step: int, logs: dict[str, Any]) -> list[Found]:
        share = finite_number(logs.get("frac_reward_zero_std"))
        if share is None or self.reported:
            return []
        self.flat = self.flat + [step] if share == 1.0 else []
        if len(self.flat) < self.settings.flat_after:
            return []
        self.reported = True
        evidence = {"reason": "frac-reward-zero-std", "logged_steps": len(self.flat), "since_step": self.flat[0],
                    "frac_reward_zero_std": share, "reward": finite_number(logs.get("reward")),
                    "grad_norm": finite_number(logs.get("grad_norm"))}
        return [("no-learning-signal", f"frac_reward_zero_std is 1.0 for {len(self.flat)} logged steps: every "
                 "group's completions got the same reward, so the advantages, the loss and the gradient are 0",
                 evidence)]


class PreferenceChecks:
    """DPO/KTO: margins that stay exactly 0, or a loss already ~0 at the first logged step."""

    def __init__(self, settings: RLSettings | None = None):
        self.settings = settings or RLSettings()
        self.flat_logs: list[dict[str, Any]] = []
        self.first_log_seen = False
        self.reported = False

    def on_log(self, step: int, logs: dict[str, Any]) -> list[Found]:
        margins, loss = finite_number(logs.get("rewards/margins")), finite_number(logs.get("loss"))
        if margins is None or loss is None or self.reported:
            return []
        first, self.first_log_seen = not self.first_log_seen, True
        if first and 0 <= loss < self.settings.zero_loss:
            self.reported = True
            return [("no-preference-signal", f"the preference loss is already {loss:.3g} at the first logged step: "
                     f"the sigmoid is saturated, so the gradient is ~0 (a reference model far from the policy, "
                     f"or beta too large)", {"reason": "loss-near-zero-at-start", "loss": loss, "step": step,
                                             "rewards/margins": margins, "fixes": ["lower-beta"]})]
        if margins != 0.0:
            self.flat_logs = []
            return []
        self.flat_logs.append({"step": step, "loss": loss, **{k: finite_number(logs.get(k)) for k in (
            "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected")}})
        if len(self.flat_logs) < self.settings.preference_flat_after:
            return []
        self.reported = True
        last = self.flat_logs[-1]
        identical = last["logps/chosen"] is not None and last["logps/chosen"] == last["logps/rejected"]
        reason = "chosen-identical-to-rejected" if identical else "reference-equals-policy"
        why = ("the chosen and rejected answers have the same log-probability: they are the same text" if identical
               else "the policy's log-ratios to its reference stay 0: the policy never moves away from the reference "
               "(a reference that is the policy itself, or weights that do not change)")
        at_ln2 = abs(loss - LN2) < 1e-4
        evidence = {"reason": reason, "logged_steps": len(self.flat_logs), "since_step": self.flat_logs[0]["step"],
                    "loss": loss, "loss_at_ln2": at_ln2, **{k: v for k, v in last.items() if k not in ("step", "loss")}}
        return [("no-preference-signal", f"the reward margins are exactly 0 for {len(self.flat_logs)} logged steps"
                 + (" (loss ln 2 = 0.6931)" if at_ln2 else "") + f": {why}", evidence)]


class RatioChecks:
    """GRPO's policy/old-policy ratio on the first inner step of the run.

    On the first optimizer step after a generation the policy IS the old policy: every ratio is 1 and
    nothing can be clipped. When TRL computes the old log-probabilities in a separate forward
    (``num_iterations > 1``, or generation steps not aligned with gradient accumulation) anything that
    makes two forwards differ (dropout left on: TRL's ``disable_dropout`` defaults to False and does not
    reach attention dropout) moves the ratio away from 1 and shows as clipped tokens at once.
    """

    def __init__(self, model: Any):
        self.model = model
        self.done = False

    def on_log(self, step: int, logs: dict[str, Any]) -> list[Found]:
        clipped = finite_number(logs.get("clip_ratio/region_mean"))
        if self.done or clipped is None:
            return []
        self.done = True  # only the first log of the run; later ones mix later inner steps
        if step != 0 or clipped <= 0.0:  # the first log must cover the first optimizer step alone
            return []
        dropout = dropout_settings(self.model)
        evidence = {"clip_ratio/region_mean": clipped, "clip_ratio/high_max": finite_number(logs.get("clip_ratio/high_max")),
                    "clip_ratio/low_min": finite_number(logs.get("clip_ratio/low_min")), "dropout": dropout}
        cause = (f"; dropout is on in the policy ({', '.join(f'{k}={v:g}' for k, v in list(dropout.items())[:3])}), "
                 "so the two forwards differ" if dropout else "")
        return [("ratio-mismatch", f"{clipped:.1%} of the tokens were clipped on the first inner step, where the "
                 f"policy/old-policy ratio must be exactly 1: the old log-probabilities come from a forward that "
                 f"differs from the training one{cause}", evidence)]


class CollapseChecks:
    """GRPO/RLOO: the policy's entropy, or its completions' mean length, collapsing while the reward stays flat.

    Read from TRL's own logged ``entropy``, ``completions/mean_length``, ``reward`` and ``reward_std``:
    the medians of the first ``collapse_window`` logs (the early level) against the medians of the last
    ones. A healthy run narrows too, but its reward rises; here the reward has not risen by half its
    early within-group spread. One event per collapse (entropy, length).
    """

    def __init__(self, args: Any, settings: RLSettings | None = None):
        self.settings = settings or RLSettings()
        self.config = {k: getattr(args, k, None) for k in ("temperature", "top_p", "top_k", "entropy_coef", "beta",
                                                          "num_generations", "learning_rate")}
        # the fixes this trainer's config can take: RLOOConfig has no entropy_coef
        self.fixes = [f for f in KIND_FIXES["policy-collapse"] if f != "add-entropy-bonus" or
                      isinstance(getattr(args, "entropy_coef", None), (int, float))]
        w = self.settings.collapse_window
        self.early: list[dict[str, Any]] = []  # the first w logs
        self.recent: deque[dict[str, Any]] = deque(maxlen=w)  # the last w logs (a long run keeps no more)
        self.count = 0
        self.reported: set[str] = set()

    def on_log(self, step: int, logs: dict[str, Any]) -> list[Found]:
        row = {"step": step, "entropy": finite_number(logs.get("entropy")),
               "length": finite_number(logs.get("completions/mean_length")), "reward": finite_number(logs.get("reward")),
               "reward_std": finite_number(logs.get("reward_std"))}
        if row["reward"] is None or (row["entropy"] is None and row["length"] is None):
            return []
        w = self.settings.collapse_window
        if len(self.early) < w:
            self.early.append(row)
        self.recent.append(row)
        self.count += 1
        if self.count < 2 * w or len(self.reported) == 2:
            return []
        early, recent = self.early, list(self.recent)

        def level(rows: list[dict[str, Any]], key: str) -> float | None:
            values = [r[key] for r in rows if r[key] is not None]
            return statistics.median(values) if len(values) == len(rows) else None

        r0, r1 = level(early, "reward"), level(recent, "reward")
        spread = statistics.median([r["reward_std"] for r in early if r["reward_std"] is not None] or [0.0])
        if r0 is None or r1 is None or r1 - r0 > self.settings.reward_gain * spread:
            return []  # the reward improves: a policy that narrows onto better answers is learning
        found: list[Found] = []
        base = {"early_steps": [early[0]["step"], early[-1]["step"]], "recent_steps": [recent[0]["step"],
                recent[-1]["step"]], "reward_early": r0, "reward_now": r1, "reward_std_early": spread,
                "logged_steps": self.count, "settings": dict(self.config), "fixes": list(self.fixes)}
        flat = (f"while the reward stayed flat ({r0:.3g} -> {r1:.3g}, within-group std {spread:.3g})")
        e0, e1 = level(early, "entropy"), level(recent, "entropy")
        if "entropy" not in self.reported and e0 is not None and e1 is not None and e0 > 0 \
                and e1 < self.settings.entropy_fraction * e0:
            self.reported.add("entropy")
            found.append(("policy-collapse", f"the policy's entropy fell from {e0:.3g} to {e1:.3g} ({e1 / e0:.0%} of "
                          f"its early level) {flat}: it narrows onto answers that are not better, its completions "
                          "stop differing and the groups stop teaching", {
                              "reason": "entropy-collapse", "entropy_early": e0, "entropy_now": e1,
                              "fraction": e1 / e0, **base}))
        l0, l1 = level(early, "length"), level(recent, "length")
        if "length" not in self.reported and l0 is not None and l1 is not None and l0 > 0 \
                and l1 <= self.settings.length_fraction * l0:
            self.reported.add("length")
            found.append(("policy-collapse", f"the mean completion length fell from {l0:.3g} to {l1:.3g} tokens "
                          f"({l1 / l0:.0%}) {flat}: the policy learns to stop early rather than to answer better", {
                              "reason": "length-collapse", "length_early": l0, "length_now": l1,
                              "fraction": l1 / l0, **base}))
        return found


class ReferenceChecks:
    """GRPO/RLOO with ``beta > 0``: the KL to the reference on step 0, where the policy is still the
    initial model and the reference is meant to be that same model, so every per-token KL is 0.

    Judged on the first log only when it covers step 0 alone (``logging_steps=1`` or
    ``logging_first_step=True``). With ``beta == 0`` TRL has no reference and computes no KL (it logs
    none; older releases logged NaN): nothing here reads it, and no other check reads ``kl``.
    """

    def __init__(self, trainer: Any, settings: RLSettings | None = None):
        self.settings = settings or RLSettings()
        self.trainer = trainer
        beta = getattr(trainer, "beta", None)
        beta = beta if isinstance(beta, (int, float)) else getattr(getattr(trainer, "args", None), "beta", None)
        self.beta = float(beta) if isinstance(beta, (int, float)) else None
        self.done = not self.beta  # beta 0 (or unknown): no KL to judge

    def on_log(self, step: int, logs: dict[str, Any]) -> list[Found]:
        kl = finite_number(logs.get("kl"))
        if self.done or kl is None:
            return []
        self.done = True  # the first log with a KL; later ones cover a policy that has moved
        if step != 0 or kl <= self.settings.kl_at_start:
            return []
        facts = reference_facts(self.trainer)
        differs = [k for k in ("dtype", "dropout", "loaded_from")
                   if k in facts["reference"] and facts["policy"].get(k) != facts["reference"][k]]
        hint = (f"; they differ in {', '.join(differs)}" if differs else "")
        evidence = {"kl": kl, "beta": self.beta, "threshold": self.settings.kl_at_start, "differs_in": differs, **facts}
        return [("kl-at-start", f"the KL to the reference is {kl:.3g} on step 0, where the policy still is the model the "
                 f"reference was made from and the KL must be ~0: the reference is not the initial policy (another "
                 f"checkpoint, a different dtype or quantisation, dropout on in one of them){hint}; beta={self.beta:g} "
                 "pulls the policy towards the wrong model", evidence)]


def reference_facts(trainer: Any) -> dict[str, Any]:
    """What the policy and its reference are (dtype, dropout, where they were loaded from): read only on an event."""
    import torch

    def facts(model: Any) -> dict[str, Any]:
        if not isinstance(model, torch.nn.Module):
            return {}
        dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()})
        config = getattr(model, "config", None)
        return {"dtype": ",".join(dtypes), "dropout": dropout_settings(model) if model.training else {},
                "training": model.training, "loaded_from": getattr(config, "_name_or_path", None) or None}

    ref, policy = getattr(trainer, "ref_model", None), getattr(trainer, "model", None)
    out = {"policy": facts(policy), "reference": facts(ref) if ref is not None else {"adapter_disabled": True},
           "reference_kind": "ref_model" if ref is not None else "the policy with its adapter disabled"}
    if isinstance(ref, torch.nn.Module) and isinstance(policy, torch.nn.Module):
        out["weights"] = weight_distance(policy, ref)
    return out


def weight_distance(policy: Any, reference: Any) -> dict[str, Any]:
    """How far the reference's weights are from the policy's (one optimizer step moves the policy a little):
    the relative L2 distance over the parameters both have, and the names only one of them has. Read in
    chunks, so a large embedding never needs a second full-size copy on its device."""
    import torch

    mine, theirs = dict(policy.named_parameters()), dict(reference.named_parameters())
    shared = [n for n in mine if n in theirs and mine[n].shape == theirs[n].shape]
    diff = total = 0.0
    with torch.no_grad():
        for name in shared:
            a, b = mine[name].detach().reshape(-1), theirs[name].detach().reshape(-1)
            d = t = torch.zeros((), dtype=torch.float64, device=a.device)
            for i in range(0, a.numel(), WEIGHT_CHUNK):
                x, y = a[i:i + WEIGHT_CHUNK].float(), b[i:i + WEIGHT_CHUNK].to(a.device).float()
                d = d + (x - y).double().pow(2).sum()
                t = t + y.double().pow(2).sum()
            diff, total = diff + float(d), total + float(t)
    return {"relative_l2": math.sqrt(diff / total) if total > 0 else None, "shared_parameters": len(shared),
            "only_in_policy": len(mine) - len(shared), "only_in_reference": len(theirs) - len(shared)}


def dropout_settings(model: Any) -> dict[str, float]:
    """Where ``model`` drops out in training: nn.Dropout modules and attention's own ``attention_dropout``."""
    import torch

    found: dict[str, float] = {}
    for name, module in model.named_modules() if isinstance(model, torch.nn.Module) else []:
        p = module.p if isinstance(module, torch.nn.Dropout) else getattr(module, "attention_dropout", None)
        if isinstance(p, (int, float)) and p > 0:
            found[name or "<model>"] = float(p)
    return found


KIND_FIXES = {"nonfinite-reward": ["finite-rewards"], "ratio-mismatch": ["disable-dropout"],
              "policy-collapse": ["raise-temperature", "add-entropy-bonus"],
              # equal rewards in every group from sampling too cold for a group's completions to differ;
              # nbguard.verify(event) samples a generation under it (verifier/rl_signal.py)
              "no-learning-signal": ["raise-temperature"]}


class TRLChecks:
    """The RL and preference checks of one TRL trainer: a reward tap installed while bound, the
    findings of the reward calls since the last step end, and the preference checks over the log."""

    def __init__(self, trainer: Any, on_error, settings: RLSettings | None = None):
        from ...introspect.trl import GENERATING, completion_cap, eos_token_id, group_size, trl_stack

        self.stack = trl_stack(trainer)
        self.trainer = trainer
        self.settings = settings or RLSettings()
        self.rewards = RewardChecks(group_size(trainer), completion_cap(trainer), eos_token_id(trainer),
                                    self.settings) if self.stack in GENERATING else None
        self.preference = PreferenceChecks(self.settings)
        self.ratio = RatioChecks(trainer.model) if self.stack in GENERATING else None
        sampled = self.stack in ("grpo", "rloo")  # TRL logs entropy, mean length and kl for these
        self.collapse = CollapseChecks(getattr(trainer, "args", None), self.settings) if sampled else None
        self.reference = ReferenceChecks(trainer, self.settings) if sampled else None
        self.rollout = RolloutDrift(trainer, on_error) if self.stack == "grpo" else None  # sampled vs scored
        self.logged_flat: LoggedFlatness | None = None  # set on bind when a reward is a model the tap cannot see
        self.pending: list[Found] = []
        self.step = 0  # the watch's current optimizer step: reward calls happen inside it
        self._on_error = on_error
        self._tap: RewardTap | None = None

    def bind(self) -> None:
        if self.rollout is not None:
            self.rollout.bind()
        if self.rewards is not None and self._tap is None:
            self._tap = RewardTap(self.trainer, self._observe, self._on_error)
            if self._tap.wrapped < len(getattr(self.trainer, "reward_funcs", None) or []) and self.logged_flat is None:
                self.logged_flat = LoggedFlatness(self.settings)

    def unbind(self) -> None:
        if self.rollout is not None:
            self.rollout.unbind()
        if self._tap is not None:
            self._tap.remove()
            self._tap = None

    def _observe(self, call: RewardCall) -> None:
        if self.rewards is not None:
            self.pending.extend(self.rewards.observe(call, self.step))

    def take(self) -> list[Found]:
        """The reward findings since the last call (at the watch's step end)."""
        found, self.pending = self.pending, []
        return found

    def on_log(self, step: int, logs: dict[str, Any]) -> list[Found]:
        found = self.preference.on_log(step, logs)
        for check in (self.ratio, self.logged_flat, self.collapse, self.reference, self.rollout):
            if check is not None:
                found += check.on_log(step, logs)
        return found
