"""Verified fixes: every candidate fix is run on the user's own failing step, on a shadow of the model.

``verify(event)`` uses the step the watch captured for its first localised event;
``verify(finding, model=..., batch=...)`` (and ``audit(..., verify=True)``) a batch the caller gives.
The result is a :class:`Verification`: "verified", "not enough" or "not checked" per fix, with evidence.
"""
from __future__ import annotations

from typing import Any

from .. import fixes as fix_registry
from ..findings import Event, Finding
from ..introspect.inputs import check_batch
from ..session import SESSION, record_verification
from ..step.batch import forward_kwargs, model_device, synthetic_batch
from ..step.capture import MicroBatch, capture_rng
from ..step.eager import eager_name
from ..step.plan import CapturedStep, NotCheckable, ShadowPlan
from ..step.precision import PrecisionUnavailable, args_mixed_precision, trainer_autocast
from ..step.targets import resolve_targets
from .candidates import CAUSE_FIXES, applies, event_fix_ids, for_event, with_options
from .engine import verify_step
from .reaudit import merged, reaudit_verdicts, split_by_reaudit
from .result import NOT_CHECKED, NOT_ENOUGH, VERDICTS, VERIFIED, FixVerdict, ModuleCheck, StepEvidence, Verification
from .rl_signal import PROBES, verify_rl_signal

AUTO_MAX_STEP_RUNS = 2  # plus the module level: automatic verification stays within 3 step times
# GradScaler overflows: "skipped-steps" (a streak), and "scaler-skip" (each skipped step; branch stacks adds it)
VERIFIABLE_KINDS = ("nonfinite-loss", "nonfinite-grad", "skipped-steps", "scaler-skip")
# events no backward can prove a fix for: their settings fixes are verified on the trainer's first batch
# (a generation, a preference loss: rl_signal.py)
RL_SIGNAL_KINDS = tuple(PROBES)


def _subject_of_event(event: Any) -> str:
    origin = event.origins[0] if event.origins else None
    where = f" in {origin.module or '<model>'} ({origin.phase})" if origin is not None else ""
    return f"step {event.step} {event.kind}: {event.cause or 'cause unknown'}{where}"


def step_from_event(event: Any, model: Any, micro_batches: list, args: Any = None) -> CapturedStep:
    """The captured step of ``event`` (its origin named in eager terms: torch.compile's prefix dropped);
    ``args``: the Trainer's TrainingArguments when a Trainer ran it."""
    origin = event.origins[0] if event.origins else None
    name = eager_name(origin.module) if origin is not None else None
    return CapturedStep(model, list(micro_batches), name, origin.phase if origin else None,
                        (origin.micro_batch or 0) if origin else 0, event.cause != "not-reproducible", args)


def step_from_batch(model: Any, batch: dict | None = None, args: Any = None) -> CapturedStep:
    """A one-micro-batch step from a batch (the probe's synthetic batch when None), in the args' precision."""
    if batch is None:
        batch = synthetic_batch(model)
    check_batch(batch)
    kwargs = forward_kwargs(model, batch)
    try:  # the autocast the Trainer's accelerator would enter for these args on this device
        autocast = trainer_autocast(args_mixed_precision(args), model_device(model).type) if args is not None else []
    except PrecisionUnavailable:
        autocast = []  # the Trainer refuses these args here: nothing to reproduce but the weights' own precision
    step = CapturedStep(model, [MicroBatch(0, (), kwargs, capture_rng(), autocast)], args=args)
    step.modes = [(m, True) for m, _ in step.modes]  # a training step, as model.train() / the Trainer runs it
    return step


def _kept_step(event: Any, watch: Any = None) -> tuple[Any, CapturedStep | None]:
    """(the watch, the step it kept for ``event``), searching this session's watches when none is given."""
    watches = [watch] if watch is not None else list(SESSION.watches)
    for w in watches:
        kept = w.captured_step(event)
        if kept is not None:
            return w, kept[1]
    return watch, None


def verify(subject: Any, fix_id: str | None = None, *, model: Any = None, batch: dict | None = None,
           trainer: Any = None, args: Any = None, watch: Any = None, options: dict | None = None,
           memory_budget: float | None = None, hardware: Any = None) -> Verification:
    """Verify the fixes of a watch event (on its captured step) or an audit finding (on ``batch``).

    ``fix_id`` checks one fix only; ``options`` gives a fix's options ({"switch-precision": {"to": "fp32"}});
    ``hardware`` the target the fixes are chosen for (default: the one named to the last audit, else this
    machine); ``memory_budget`` (bytes) caps the step-level check (default: half the free memory of the
    model's device). Each verdict records the exact cell that ran, in the session's variable names.
    """
    hardware = hardware if hardware is not None else SESSION.target_hardware
    if fix_id is not None:
        fix_registry.get(fix_id)  # an unknown id: the error lists the valid ones
    if options is not None and not isinstance(options, dict):
        raise TypeError(f"options must be a dict of fix id -> options, got {type(options).__name__}")
    if isinstance(subject, Event) and subject.kind in RL_SIGNAL_KINDS:
        watch = watch if watch is not None else next((w for w in SESSION.watches if subject in getattr(w, "events", ())), None)
        trainer = trainer if trainer is not None else getattr(watch, "trainer", None)
        if trainer is None:
            raise ValueError(f"a {subject.kind} event's fixes are verified on its trainer's first batch: pass "
                             "trainer= (the TRL trainer that ran)")
        fix_ids = [fix_id] if fix_id else list(subject.evidence.get("fixes") or [])
        given = options or {}
        return _recorded(verify_rl_signal(
            subject.kind, f"step {subject.step} {subject.kind}", trainer, fix_ids,
            {f: {**fix_registry.get(f).options_for(hardware), **given.get(f, {})} for f in fix_ids},
            SESSION.fix_names("trainer")))
    if isinstance(subject, Event):
        watch, step = _kept_step(subject, watch)
        if step is None:
            raise ValueError("this event's step was not captured: a watch keeps the failing step of its first "
                             "localised non-finite event (nbguard.watch(..., verify=True), the default). Verify a "
                             "finding on a batch instead: nbguard.verify(finding, model=model, batch=batch)")
        moved = step.weights_moved()
        if moved:
            raise ValueError(f"the model's weights changed since step {subject.step} was captured ({len(moved)} "
                             f"parameters, e.g. {moved[0]}: an optimizer step or a fix), so that step can no longer "
                             f"be re-run as it failed. The verification made when it failed is watch.verification "
                             f"(also event.evidence['verification']); verify on a batch with "
                             f"nbguard.verify(finding, model=model, batch=batch)")
        optimizer = getattr(watch, "optimizer", None)
        fix_ids = [fix_id] if fix_id else [f for f in event_fix_ids(subject, optimizer) if applies(f, step, optimizer)]
        candidates = with_options(fix_ids, step, options, hardware)
        names = loop_names(watch, SESSION.fix_names("trainer" if getattr(watch, "trainer", None) is not None else "model"))
        return _recorded(verify_step(step, candidates, _subject_of_event(subject), memory_budget=memory_budget,
                                     names=names))
    if isinstance(subject, Finding):
        model, args, _ = resolve_targets(trainer, model, args)
        if model is None:
            raise ValueError("verifying a finding needs the model (model= or trainer=) and a batch to run the step on "
                             "(batch=; without it the probe's synthetic batch is used)")
        fix_ids = [fix_id] if fix_id else list(subject.fixes)
        names = SESSION.fix_names("trainer" if trainer is not None else "model")
        # a data or config fix (no step recipe) is re-audited on a shadow of the trainer as built (reaudit.py)
        by_reaudit, by_step = split_by_reaudit(fix_ids, trainer, args)
        given = options or {}
        reaudited = reaudit_verdicts(
            [subject], by_reaudit, {f: {**fix_registry.get(f).options_for(hardware), **given.get(f, {})}
                                    for f in by_reaudit},
            model=model, trainer=trainer, args=args, batch=batch, hardware=hardware, names=names,
            check_baseline=True) if by_reaudit else []
        stepped = None
        if by_step:
            step = step_from_batch(model, batch, args)
            stepped = verify_step(step, with_options(by_step, step, options, hardware), f"finding {subject.rule}",
                                  memory_budget=memory_budget, names=names)
        return _recorded(merged(stepped, reaudited, f"finding {subject.rule}"))
    raise TypeError(f"verify() takes a watch Event or an audit Finding, got {type(subject).__name__}")


def loop_names(watch: Any, names: dict[str, str]) -> dict[str, str]:
    """A plain loop's watch: its cells name its optimizer (the usual variable name when the notebook did not say)."""
    if getattr(watch, "trainer", None) is None and getattr(watch, "optimizer", None) is not None:
        names.setdefault("optimizer", "optimizer")
    return names


def _recorded(verification: Verification) -> Verification:
    """The verification, on the session's timeline (the report tells it, %nbguard fix reads its verdicts)."""
    record_verification(verification)
    return verification


def auto_verify(watch: Any, event: Any) -> None:
    """The watch's first localised non-finite event: keep its step and verify its fixes, bounded.

    Never raises: a failure is recorded on the event as ``verification_error``.
    """
    if watch.captured_step(None) is not None:
        return
    if event.kind not in VERIFIABLE_KINDS or event.cause not in CAUSE_FIXES or not watch.micro_batches:
        return
    try:
        step = step_from_event(event, watch.model, list(watch.micro_batches))
        step.args = watch.trainer.args if watch.trainer is not None else None
        watch.keep_step(event, step)
        # the fixes the target would run (the hardware named to the audit: fp32 for a T4, never bf16)
        candidates = for_event(event, step, hardware=SESSION.target_hardware, optimizer=getattr(watch, "optimizer", None))
        names = loop_names(watch, SESSION.fix_names("trainer" if watch.trainer is not None else "model"))
        result = verify_step(step, candidates, _subject_of_event(event), max_step_runs=AUTO_MAX_STEP_RUNS,
                             baseline=False, names=names)
        watch.verification = result
        event.evidence["verification"] = result.to_dict()  # on the timeline inside the watch's document
    except Exception as exc:  # verification must never break the user's training
        event.evidence["verification_error"] = f"{type(exc).__name__}: {exc}"


__all__ = ["CAUSE_FIXES", "NOT_CHECKED", "NOT_ENOUGH", "VERDICTS", "VERIFIED", "CapturedStep", "FixVerdict",
           "ModuleCheck", "NotCheckable", "ShadowPlan", "StepEvidence", "Verification", "auto_verify",
           "step_from_batch", "step_from_event", "verify"]
