"""``nbguard.audit(..., verify=True)``: the findings' fixes verified on the given batch."""
from __future__ import annotations

from typing import Any

from ..auditor.sampling import sample_trainer_batches
from ..findings import Finding, Severity
from ..session import SESSION
from ..step.targets import resolve_targets
from . import step_from_batch
from .candidates import with_options
from .engine import verify_step


def verify_audit(result: Any, model: Any, trainer: Any, args: Any, batch: dict | None,
                 memory_budget: float | None = None) -> None:
    """Attach a Verification of every fix the findings offer to ``result`` (and each finding's verdicts).

    When it cannot run, an info finding ``verify-error`` says why (the audit itself stands).
    """
    fix_ids = result.fix_ids
    if not fix_ids:
        return
    model, args, _ = resolve_targets(trainer, model, args)
    try:
        source = "the given batch" if batch is not None else "a synthetic batch"
        if batch is None and trainer is not None:  # a real batch from the trainer's dataloader (RNG put back)
            sample = sample_trainer_batches(trainer, count=1)
            if sample.batches:
                batch, source = sample.batches[0], "a batch from the trainer's dataloader"
        step = step_from_batch(model, batch, args)
        options = {fix_id: result.fix_options(fix_id) for fix_id in fix_ids}
        names = SESSION.fix_names("trainer" if trainer is not None else "model")
        if trainer is None and args is not None:
            names.setdefault("args", "args")
        subject = f"audit on {source}"
        verification = verify_step(step, with_options(fix_ids, step, options, result.hardware), subject,
                                   memory_budget=memory_budget, names=names)
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
