"""RL runs with no learning signal: their settings fixes verified on the trainer's own first batch.

``no-learning-signal`` (GRPO/RLOO: every group of completions got equal rewards, so the advantages, the loss
and its gradient are 0) and ``no-preference-signal`` with a loss ~0 from the start (DPO/KTO: beta x the
log-ratio margin saturates the sigmoid, so the gradient vanishes) cannot be proven fixed on a captured
backward: the gradient is 0 by construction. What the trainer computes from its first batch can:

- a generation (GRPO/RLOO): one generation batch of the trainer's data, sampled and scored by its own reward
  functions with TRL's own code (``_generate_and_score_completions``), and TRL's own measure of flat groups
  (``frac_reward_zero_std``) read;
- a preference loss (DPO/KTO): TRL's ``compute_loss`` of the first batch, without gradients.

Each runs on a shadow of the trainer (its args copied and the fix applied to them, then what TRL derives from
the args when it builds the trainer derived again): first without the fix (the failure must show on that
batch), then with each fix, from one RNG state. Nothing is trained (no backward, no update); the user's
trainer keeps its args, metrics, logs, state and reward functions, and the RNG is put back.
"""
from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .. import fixes as fix_registry
from ..auditor.sampling import forget_loader
from ..fixes.registry import Target
from ..introspect.trl import GENERATING, PREFERENCE, TAPPED, trl_stack
from ..step.capture import capture_rng, preserved_rng, restore_rng
from ..watcher.detectors.rl import RLSettings
from .reaudit import fix_cell
from .result import NOT_CHECKED, NOT_ENOUGH, VERIFIED, FixVerdict, Verification
from .shadow import quiet_watches

# What GRPO/RLOO/DPO/KTO's __init__ (TRL 1.x) derives from args for these fixes: trainer attributes, and for
# sampling the generation_config and generation_kwargs. A shadow with changed args behaves as a trainer built
# from them only once these are derived again.
DERIVED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "beta")


@dataclass(frozen=True)
class Probe:
    """How one event's fixes are judged: what is measured on the first batch and what a failing value is."""
    stacks: tuple[str, ...]
    method: str  # the TRL method the measurement runs
    fixes: tuple[str, ...]
    measure: Callable[[Any, Any], float]
    failing: Callable[[float], bool]
    metric: str
    cleared: str  # why a value that no longer fails means the run learns again
    still: str  # what a value that still fails says about the cause


def trainer_shadow(trainer: Any) -> Any:
    """A shallow copy of the trainer whose args, state, metrics and logs are its own, and whose reward functions
    are the user's (without the watch's tap: the shadow's rewards are not the run's)."""
    shadow = copy.copy(trainer)
    shadow.args = copy.deepcopy(trainer.args)
    shadow.state = copy.deepcopy(trainer.state)
    for name in ("_metrics", "_logs"):
        if hasattr(trainer, name):
            setattr(shadow, name, copy.deepcopy(getattr(trainer, name)))
    if isinstance(getattr(trainer, "reward_funcs", None), list):
        shadow.reward_funcs = [getattr(f, TAPPED, f) for f in trainer.reward_funcs]
    return shadow


def _args_as_built(shadow: Any) -> None:
    args = shadow.args
    given = {name: getattr(args, name) for name in DERIVED if hasattr(args, name)}
    for name, value in given.items():
        if hasattr(shadow, name):
            setattr(shadow, name, value)
    config = getattr(shadow, "generation_config", None)
    if config is not None:
        config = copy.deepcopy(config)
        for name, value in given.items():
            if hasattr(config, name):
                setattr(config, name, value)
        shadow.generation_config = config
    kwargs = getattr(shadow, "generation_kwargs", None)
    if isinstance(kwargs, dict):
        shadow.generation_kwargs = {**kwargs, **{n: v for n, v in given.items() if n in kwargs}}


def first_train_batch(trainer: Any) -> Any:
    """The first batch the trainer's dataloader gives (GRPO: prompt rows repeated per generation), RNG put back."""
    with preserved_rng():
        loader = trainer.get_train_dataloader()
        iterator = iter(loader)
        try:
            return next(iterator)
        finally:
            del iterator
            forget_loader(trainer, loader)


# The trainer's class methods, called on the shadow: a wrapper on the trainer itself (the watch wraps
# compute_loss) is bound to the trainer, and would read the trainer's settings instead of the shadow's.
def flat_share(shadow: Any, batch: Any) -> float:
    """TRL's ``frac_reward_zero_std`` of one generation of ``batch``: the share of groups whose completions all
    got the same reward (1.0: no learning signal at all)."""
    type(shadow)._generate_and_score_completions(shadow, batch)
    return float(shadow._metrics["train"]["frac_reward_zero_std"][-1])


def preference_loss(shadow: Any, batch: Any) -> float:
    """TRL's preference loss of ``batch`` on ``shadow``, without gradients."""
    trainer_class = type(shadow)
    with torch.no_grad():
        return float(trainer_class.compute_loss(shadow, shadow.model, trainer_class._prepare_inputs(shadow, batch)))


ZERO_LOSS = RLSettings().zero_loss
PROBES = {
    "no-learning-signal": Probe(
        GENERATING, "_generate_and_score_completions", ("raise-temperature",), flat_share, lambda v: v >= 1.0,
        "frac_reward_zero_std", "of the groups now differ in reward, so their advantages and the loss gradient are "
        "no longer 0", "every group still got equal rewards under it: the sampling is not what makes the rewards "
        "equal (a reward that scores every completion alike?)"),
    "no-preference-signal": Probe(
        PREFERENCE, "compute_loss", ("lower-beta",), preference_loss, lambda v: 0 <= v < ZERO_LOSS,
        "preference loss", "the sigmoid is no longer saturated, so the loss has a gradient again",
        "the loss is still ~0 under it: the margin to the reference is too large for this beta (a reference made "
        "from another model?)"),
}


def _verdict(fix_id: str, options: dict[str, Any], names: dict[str, str]) -> FixVerdict:
    title, code = fix_cell(fix_id, options, names)
    return FixVerdict(fix_id, NOT_CHECKED, "", dict(options), title, code)


def verify_rl_signal(kind: str, subject: str, trainer: Any, fix_ids: list[str], options: dict[str, dict[str, Any]],
                     names: dict[str, str]) -> Verification:
    """One verdict per fix: verified where the trainer's first batch under it has its learning signal back."""
    started = time.perf_counter()
    probe = PROBES[kind]
    verdicts = [_verdict(f, options.get(f, {}), names) for f in fix_ids]
    if trl_stack(trainer) not in probe.stacks or not callable(getattr(trainer, probe.method, None)):
        for v in verdicts:
            v.reason = f"not a trainer of the kind this check knows ({', '.join(probe.stacks)}, with {probe.method})"
        return Verification(subject, verdicts, step_level=False, seconds=time.perf_counter() - started)
    notes: list[str] = []
    with quiet_watches(trainer.model), preserved_rng():
        try:
            batch = first_train_batch(trainer)
            state = capture_rng()  # one RNG state for every run below: what differs comes from the fix
            before = probe.measure(trainer_shadow(trainer), batch)
        except Exception as exc:  # this trainer's TRL code refused the shadow: say so, never raise into the notebook
            for v in verdicts:
                v.reason = f"the trainer's first batch could not be run on a shadow: {type(exc).__name__}: {exc}"
            return Verification(subject, verdicts, step_level=False, seconds=time.perf_counter() - started)
        notes.append(f"without a fix: {probe.metric} {before:.3g} on the trainer's first batch")
        for verdict in verdicts:
            if verdict.fix not in probe.fixes:
                verdict.reason = f"the first batch's {probe.metric} cannot show what this fix changes"
                continue
            if not probe.failing(before):
                verdict.reason = (f"the trainer's first batch does not show the failure without any fix ({probe.metric} "
                                  f"{before:.3g}), so a fix cannot be seen to clear it")
                continue
            shadow = trainer_shadow(trainer)
            verdict.changes = fix_registry.get(verdict.fix).apply(
                Target(model=trainer.model, trainer=shadow, args=shadow.args), **verdict.options)
            if not verdict.changes:
                verdict.reason = "the fix changes nothing on this trainer (its setting is already there)"
                continue
            _args_as_built(shadow)
            restore_rng(state)
            try:
                after = probe.measure(shadow, batch)
            except Exception as exc:
                verdict.reason = f"the first batch raised under the fix: {type(exc).__name__}: {exc}"
                continue
            verdict.changes[probe.metric] = f"{before:.3g} -> {after:.3g}"
            if probe.failing(after):
                verdict.verdict = NOT_ENOUGH
                verdict.reason = f"{probe.metric} {before:.3g} -> {after:.3g}: {probe.still}"
            else:
                verdict.verdict = VERIFIED
                share = f"{1 - after:.0%} " if kind == "no-learning-signal" else ""
                verdict.reason = (f"verified on the trainer's first batch ({probe.metric} {before:.3g} -> {after:.3g}): "
                                  f"{share}{probe.cleared}")
    return Verification(subject, verdicts, step_level=False, seconds=time.perf_counter() - started, notes=notes)
