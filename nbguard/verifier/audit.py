"""``nbguard.audit(..., verify=True)``: the findings' fixes verified on the given batch, or by a re-audit.

A fix with a step recipe runs on a shadow of one training step; a data or config fix (no recipe) is
re-audited on a shadow of the trainer as built (reaudit.py) when the audit has a trainer or args.
"""
from __future__ import annotations

from typing import Any

from ..auditor.sampling import sample_trainer_batches
from ..findings import Finding, Severity
from ..introspect.inputs import is_trainer
from ..session import SESSION
from ..step.targets import resolve_targets
from . import step_from_batch
from .candidates import with_options
from .engine import verify_step
from .reaudit import merged, reaudit_verdicts, split_by_reaudit
from .result import FixVerdict, Verification


def verify_audit(result: Any, model: Any, trainer: Any, args: Any, batch: dict | None,
                 memory_budget: float | None = None) -> None:
    """Attach a Verification of every fix the findings offer to ``result`` (and each finding's verdicts).

    When it cannot run, an info finding ``verify-error`` says why (the audit itself stands).
    """
    fix_ids = result.fix_ids
    if not fix_ids:
        return
    if trainer is None and is_trainer(model):  # nbguard.audit(trainer, verify=True)
        model, trainer = None, model
    model, args, _ = resolve_targets(trainer, model, args)
    names = SESSION.fix_names("trainer" if trainer is not None else "model")
    if trainer is None and args is not None:
        names.setdefault("args", "args")
    by_reaudit, by_step = split_by_reaudit(fix_ids, trainer, args)
    options = {fix_id: result.fix_options(fix_id) for fix_id in fix_ids}
    try:
        reaudited: list[FixVerdict] = reaudit_verdicts(
            result.findings, by_reaudit, options, model=model, trainer=trainer, args=args, batch=batch,
            hardware=result.hardware, names=names) if by_reaudit else []
        verification = merged(
            _verify_steps(result, model, trainer, args, batch, by_step, options, names, memory_budget)
            if by_step else None, reaudited, "audit")
    except Exception as exc:
        result.findings.append(Finding(
            rule="verify-error", severity=Severity.INFO, title="the fixes could not be verified",
            detail=f"Running the fixes on a shadow of the step raised {type(exc).__name__}: {exc}.",
            evidence={"exception": f"{type(exc).__name__}: {exc}"}))
        return
    result.verification = verification
    for finding in result.findings:
        found = [verification.verdict(f) for f in finding.fixes]
        verdicts = {v.fix: v.verdict for v in found if v is not None}
        if verdicts:
            finding.evidence["verdicts"] = verdicts


def _verify_steps(result: Any, model: Any, trainer: Any, args: Any, batch: dict | None, fix_ids: list[str],
                  options: dict[str, dict], names: dict[str, str], memory_budget: float | None) -> Verification:
    source = "the given batch" if batch is not None else "a synthetic batch"
    if batch is None and trainer is not None:  # a real batch from the trainer's dataloader (RNG put back)
        sample = sample_trainer_batches(trainer, count=1)
        if sample.batches:
            batch, source = sample.batches[0], "a batch from the trainer's dataloader"
    step = step_from_batch(model, batch, args)
    return verify_step(step, with_options(fix_ids, step, options, result.hardware), f"audit on {source}",
                       memory_budget=memory_budget, names=names)
