"""Verify candidate fixes on a captured step: module level always, step level when memory allows."""
from __future__ import annotations

import time
from typing import Any

import torch

from .. import fixes
from ..document.view import plural
from ..findings import FixOffer
from ..step.plan import CapturedStep, NotCheckable, ShadowPlan
from .memory import check_budget, default_budget, estimate_step_bytes, gb
from .module_check import capture_inputs, reference_check, run_module
from .result import (
    NOT_CHECKED,
    NOT_ENOUGH,
    VERIFIED,
    FixVerdict,
    ModuleCheck,
    ModuleEvidence,
    StepEvidence,
    Verification,
)
from .shadow import run_step


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def fix_code(fix_id: str, options: dict[str, Any], names: dict[str, str] | None = None,
             loop: bool = False) -> tuple[str, str | None]:
    """(title, the cell that was verified) from the fix registry; ``loop``: a plain loop's step (no Trainer, no
    TrainingArguments), whose cells act on its optimizer and never name ``args.`` or ``trainer.``."""
    names = dict(names or {"model": "model"})
    fix = fixes.get(fix_id)
    if loop and not (names.get("args") or names.get("trainer")):
        if fix.needs == "args-or-optimizer":
            names.setdefault("optimizer", "optimizer")
    elif fix.needs in ("args", "model-or-args", "args-or-optimizer") and not (names.get("args") or names.get("trainer")):
        names["args"] = "args"
    if fix.needs == "trainer" or (fix.needs == "tokenizer" and not names.get("trainer")):
        # the usual variable name; with a trainer, a tokenizer cell names its processing_class, as the audit's does
        names.setdefault(fix.needs, fix.needs)
    try:
        return fix.title, fixes.code(fix_id, **names, **options)
    except Exception:  # e.g. a fix whose cell needs a name nbguard does not have here (a tokenizer)
        return fix.title, None


def _plan(fix_id: str, options: dict[str, Any], step: CapturedStep) -> ShadowPlan | str:
    """The fix's plan, or why it cannot be checked."""
    plan = fixes.get(fix_id).plan
    if plan is None:
        return "no shadow recipe for this fix yet (its Fix has no plan): it was not run on the failing step"
    try:
        return plan(step, **options)
    except NotCheckable as exc:
        return str(exc)


def _healthy_reason(s: StepEvidence) -> str:
    norm = "" if s.total_grad_norm is None else f", grad norm {s.total_grad_norm:.4g}"
    tokens = "" if s.supervised_tokens is None else f" over {s.supervised_tokens} supervised tokens"
    return f"the failing step is healthy under it: loss {s.loss:.4g}{tokens}{norm}, every gradient finite"


def _nothing_to_judge(s: StepEvidence) -> tuple[str, str] | None:
    """(verdict, reason) when a healthy-looking step trained on nothing: no rows, no supervised token, no loss."""
    if s.micro_batches == 0:
        return NOT_ENOUGH, "no data is left under it: it drops every row of the step, so nothing would be trained"
    if s.supervised_tokens == 0:
        return NOT_ENOUGH, "no supervised token is left under it (every label -100 after the shift): the loss is 0/0"
    if s.loss is None:
        return NOT_CHECKED, ("the step computes no loss in the model (a loss computed outside it is not re-run), "
                             "so a healthy training step cannot be shown")
    return None


def _sick_reason(s: StepEvidence) -> str:
    return f"still non-finite under it: {s.first_nonfinite or ('loss ' + str(s.loss))}"


def verify_step(step: CapturedStep, candidates: list[FixOffer], subject: str, *,
                memory_budget: float | None = None, max_step_runs: int | None = None, baseline: bool = True,
                names: dict[str, str] | None = None) -> Verification:
    """Every candidate on ``step``; ``max_step_runs`` bounds the step-level runs (automatic verification)."""
    started = time.perf_counter()
    budget = check_budget(memory_budget)
    budget = budget if budget is not None else default_budget(step.eager)
    plans = [(offer.id, offer.options, _plan(offer.id, offer.options, step)) for offer in candidates]
    notes: list[str] = []

    # memory: the step without substitutions first; each plan's own new tensors on top
    base = estimate_step_bytes(step.eager, step.micro_batches, {})
    memory: dict[str, Any] = {"estimate": base, "budget": budget}
    step_skipped = None
    if budget is not None and base["total"] > budget:
        step_skipped = (f"the step needs about {gb(base['total'])} (gradients {gb(base['gradients'])}, activations "
                        f"{gb(base['activations'])}) and the budget is {gb(budget)}: only the module level ran")

    broken = _nonfinite_weights(step)
    if broken is not None:  # no re-run of this step can show a fix: each verdict says so instead of "not enough"
        step_skipped = broken
    module_check, inputs = _module_level(step) if broken is None else (None, None)
    baseline_evidence = None
    runs = 0
    cache: dict[tuple, StepEvidence | BaseException] = {}
    if baseline and step_skipped is None:
        baseline_evidence = run_step(step, ShadowPlan())
        cache[ShadowPlan().key()] = baseline_evidence
        if baseline_evidence.healthy:
            notes.append("the step is healthy without any fix: there is no failure on it for a fix to remove")

    verdicts = []
    for fix_id, options, plan in plans:
        title, code = fix_code(fix_id, options, names, loop=step.args is None)
        verdict = FixVerdict(fix_id, NOT_CHECKED, "", options, title, code)
        if isinstance(plan, str):
            verdict.reason = plan
            verdicts.append(verdict)
            continue
        verdict.changes = dict(plan.changes)
        if plan.empty:
            verdict.reason = "it changes nothing this step computes on this model (already applied, or nothing to change)"
            verdicts.append(verdict)
            continue
        if inputs is not None:
            try:
                verdict.module = run_module(step, inputs, plan)
            except Exception as exc:  # the module check is evidence; the step level decides
                notes.append(f"module level under {fix_id}: {type(exc).__name__}: {exc}")
        if broken is not None:
            verdict.reason = broken
        elif baseline_evidence is not None and baseline_evidence.healthy:
            verdict.reason = "the step is healthy without it, so this batch cannot show what it changes"
        elif step_skipped is not None:
            _module_only(verdict, step_skipped)
        elif budget is not None and base["total"] + sum(t.numel() * t.element_size() for t in plan.tensors.values()) > budget:
            verdict.reason = f"its new tensors push the step past the memory budget of {gb(budget)}"
            _module_only(verdict, verdict.reason)
        elif max_step_runs is not None and runs >= max_step_runs and plan.key() not in cache:
            verdict.reason = f"the automatic verification's bound ({max_step_runs} step runs) was spent; " \
                             f"run nbguard.verify(event, fix_id={fix_id!r}) to check it"
        else:
            if plan.key() not in cache:
                runs += 1
                try:
                    cache[plan.key()] = run_step(step, plan)
                except Exception as exc:
                    cache[plan.key()] = exc
            _judge(verdict, cache[plan.key()], plan)
        verdicts.append(verdict)
    return Verification(subject, verdicts, baseline_evidence, module_check, step_skipped is None, step_skipped,
                        memory, time.perf_counter() - started, notes)


def _nonfinite_weights(step: CapturedStep) -> str | None:
    """Why the step cannot judge a fix when its weights were non-finite before it ran (an earlier update made
    them so: Adam's eps rounding to 0 in float16, say); else None. One read for every weight."""
    params = [(n, p) for n, p in step.eager.named_parameters() if p.is_floating_point()]
    if not params:
        return None
    try:
        finite = torch.stack([torch.isfinite(p.detach()).all().to(params[0][1].device) for _, p in params]).tolist()
    except Exception:  # a tensor subclass (a sharded or quantised weight) that cannot say: judge the step as before
        return None
    bad = [n for (n, _), ok in zip(params, finite) if not ok]
    if not bad:
        return None
    return (f"the weights were already non-finite when this step began ({plural(len(bad), 'parameter')}, e.g. "
            f"{bad[0]}): an earlier update made them so, so no re-run of this step can show a fix; the fixes are "
            "offered unverified, what the audit predicted first")


def _module_level(step: CapturedStep) -> tuple[ModuleCheck | None, tuple | None]:
    if step.origin_module is None:
        return None, None
    if step.origin_phase != "forward":
        return ModuleCheck(step.origin_module or "<model>", step.origin_phase or "?",
                           skipped="the origin is in backward; the module level re-runs forwards only, the step "
                                   "level checks the gradients"), None
    try:
        inputs = capture_inputs(step)
        return reference_check(step, inputs), inputs
    except Exception as exc:
        return ModuleCheck(step.origin_module or "<model>", "forward",
                           skipped=f"could not re-run the origin alone: {type(exc).__name__}: {exc}"), None


def _module_only(verdict: FixVerdict, why: str) -> None:
    module: ModuleEvidence | None = verdict.module
    if module is not None and not module.finite:
        verdict.verdict = NOT_ENOUGH
        verdict.reason = f"the origin {module.module} is still non-finite under it ({why})"
    else:
        verdict.reason = why + ("; the origin module's output is finite under it" if module is not None else "")


def _judge(verdict: FixVerdict, outcome: StepEvidence | BaseException, plan: ShadowPlan) -> None:
    if isinstance(outcome, BaseException):
        if _is_oom(outcome):
            verdict.reason = f"the shadow step ran out of memory: {outcome}"
        else:
            verdict.verdict = NOT_ENOUGH
            verdict.reason = f"the step raises under it: {type(outcome).__name__}: {outcome}"
        return
    verdict.step = outcome
    empty = _nothing_to_judge(outcome) if outcome.healthy else None
    if empty is not None:
        verdict.verdict, verdict.reason = empty
    elif outcome.healthy:
        verdict.verdict, verdict.reason = VERIFIED, _healthy_reason(outcome)
    else:
        verdict.verdict, verdict.reason = NOT_ENOUGH, _sick_reason(outcome)
    if plan.note:
        verdict.reason += f" ({plan.note})"
