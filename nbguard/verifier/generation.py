"""A GRPO/RLOO run with no learning signal: its sampling fixes verified on a generation step of the trainer.

``no-learning-signal`` means every group of completions got equal rewards: the advantages are 0, so the
loss and its gradient are 0. No captured backward can prove a fix for that; a generation can. On a shadow of
the trainer (its args copied and the fix applied to them, then the sampling settings TRL derives from the
args when it builds the trainer derived again), one generation batch of the trainer's own data is sampled
and scored by the trainer's own reward functions, with TRL's own code (``_generate_and_score_completions``),
and TRL's own measure of flat groups (``frac_reward_zero_std``) is read: first without the fix (the failure
must show on this batch), then with it, from the same RNG state. Nothing is trained (no backward, no
update); the user's trainer keeps its args, metrics, logs, state and reward functions, and the RNG is put back.
"""
from __future__ import annotations

import copy
import time
from typing import Any

from .. import fixes as fix_registry
from ..auditor.sampling import forget_loader, preserved_rng
from ..fixes.registry import Target
from ..introspect.trl import GENERATING, TAPPED, trl_stack
from ..step.capture import capture_rng, restore_rng
from .result import NOT_CHECKED, NOT_ENOUGH, VERIFIED, FixVerdict, Verification
from .shadow import quiet_watches

GENERATION_FIXES = ("raise-temperature",)
# What GRPO/RLOO's __init__ (TRL 1.x) derives from args for sampling: trainer attributes, generation_config and
# generation_kwargs. A shadow with changed args samples with them only once these are derived again.
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def _shadow(trainer: Any) -> Any:
    """A shallow copy of the trainer whose args, state, metrics and logs are its own, and whose reward functions
    are the user's (without the watch's tap: the shadow's rewards are not the run's)."""
    shadow = copy.copy(trainer)
    shadow.args = copy.deepcopy(trainer.args)
    shadow.state = copy.deepcopy(trainer.state)
    for name in ("_metrics", "_logs"):
        if hasattr(trainer, name):
            setattr(shadow, name, copy.deepcopy(getattr(trainer, name)))
    shadow.reward_funcs = [getattr(f, TAPPED, f) for f in trainer.reward_funcs]
    return shadow


def _sampling_as_built(shadow: Any) -> None:
    args = shadow.args
    given = {name: getattr(args, name) for name in SAMPLING if hasattr(args, name)}
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


def first_generation_batch(trainer: Any) -> list[dict[str, Any]]:
    """The first batch of prompts the trainer's dataloader gives (rows repeated per generation), RNG put back."""
    with preserved_rng():
        loader = trainer.get_train_dataloader()
        iterator = iter(loader)
        try:
            return next(iterator)
        finally:
            del iterator
            forget_loader(trainer, loader)


def flat_share(shadow: Any, batch: list[dict[str, Any]]) -> float:
    """TRL's ``frac_reward_zero_std`` of one generation of ``batch`` on ``shadow``: the share of groups whose
    completions all got the same reward (1.0: no learning signal at all)."""
    shadow._generate_and_score_completions(batch)
    return float(shadow._metrics["train"]["frac_reward_zero_std"][-1])


def _verdict(fix_id: str, options: dict[str, Any], names: dict[str, str]) -> FixVerdict:
    fix = fix_registry.get(fix_id)
    try:
        code = fix_registry.code(fix_id, **names, **options)
    except ValueError:  # a cell that needs a name the session does not have
        code = None
    return FixVerdict(fix_id, NOT_CHECKED, "", dict(options), fix.title, code)


def verify_generation(subject: str, trainer: Any, fix_ids: list[str], options: dict[str, dict[str, Any]],
                      names: dict[str, str]) -> Verification:
    """One verdict per fix: verified where a generation under it gives some group a reward spread again."""
    started = time.perf_counter()
    verdicts = [_verdict(f, options.get(f, {}), names) for f in fix_ids]
    notes: list[str] = []
    if trl_stack(trainer) not in GENERATING or not callable(getattr(trainer, "_generate_and_score_completions", None)):
        for v in verdicts:
            v.reason = "not a GRPO/RLOO trainer this TRL lets nbguard sample from (_generate_and_score_completions)"
        return Verification(subject, verdicts, step_level=False, seconds=time.perf_counter() - started)
    model = trainer.model
    with quiet_watches(model), preserved_rng():
        batch = first_generation_batch(trainer)
        state = capture_rng()  # one RNG state for every generation below: what differs comes from the fix
        before = flat_share(_shadow(trainer), batch)
        notes.append(f"without a fix: frac_reward_zero_std {before:.3g} on the first generation batch "
                     f"({len(batch)} completions)")
        for verdict in verdicts:
            if verdict.fix not in GENERATION_FIXES:
                verdict.reason = "not a sampling fix: a generation step cannot show what it changes"
                continue
            if before < 1.0:
                verdict.reason = (f"the first generation batch has a reward spread without any fix (frac_reward_zero_std "
                                  f"{before:.3g}): the failure does not show on it, so a fix cannot be seen to clear it")
                continue
            shadow = _shadow(trainer)
            verdict.changes = fix_registry.get(verdict.fix).apply(
                Target(model=model, trainer=shadow, args=shadow.args), **verdict.options)
            if not verdict.changes:
                verdict.reason = "the fix changes nothing on this trainer (its setting is already there)"
                continue
            _sampling_as_built(shadow)
            restore_rng(state)
            after = flat_share(shadow, batch)
            verdict.changes["frac_reward_zero_std"] = f"{before:.3g} -> {after:.3g}"
            if after < 1.0:
                verdict.verdict = VERIFIED
                verdict.reason = (f"verified on a generation of the trainer's first batch: {1 - after:.0%} of the groups "
                                  f"now differ in reward (frac_reward_zero_std {before:.3g} -> {after:.3g}), so their "
                                  "advantages and the loss gradient are no longer 0")
            else:
                verdict.verdict = NOT_ENOUGH
                verdict.reason = (f"every group still got equal rewards under it (frac_reward_zero_std {after:.3g}): "
                                  "the sampling is not what makes the rewards equal (a reward that scores every "
                                  "completion alike?)")
    return Verification(subject, verdicts, step_level=False, seconds=time.perf_counter() - started, notes=notes)

