"""The precision audit: rules over model, trainer, args, batch and hardware, and the activation probe.

``run_audit`` builds one :class:`AuditContext` of lazily computed facts, runs every registered
rule against it (a failing rule becomes an info finding, never a failed audit) and returns an
:class:`AuditResult`.
"""
from __future__ import annotations

from ..findings import Finding, Severity
from ..hardware import resolve_hardware
from ..introspect.inputs import check_args, check_batch, check_model, check_trainer
from ..session import record_audit
from . import rules as _rules  # noqa: F401  (registers every rule)
from .context import AuditContext
from .probe import ProbeResult, run_probe
from .registry import RULES, Rule, rule
from .result import AuditResult


def _run_rules(ctx: AuditContext) -> list[Finding]:
    found: list[Finding] = []
    for r in RULES.values():
        try:
            out = r.check(ctx)
        except Exception as exc:  # one broken rule must not hide what the others found
            found.append(Finding(
                rule="rule-error", severity=Severity.INFO, title=f"rule {r.id} could not run",
                detail=f"The rule {r.id} raised {type(exc).__name__}: {exc}. The other rules ran normally.",
                evidence={"rule": r.id, "exception": f"{type(exc).__name__}: {exc}"},
            ))
            continue
        if out is None:
            continue
        found.extend(out if isinstance(out, list) else [out])
    return found


def run_audit(model=None, trainer=None, *, args=None, batch=None, hardware=None, probe=False) -> AuditResult:
    """Audit a fine-tuning setup; see ``nbguard.audit``."""
    if trainer is not None:
        check_trainer(trainer)
        model = trainer.model if model is None else model
        args = trainer.args if args is None else args
    if model is None:
        raise ValueError("nbguard.audit needs model= (a torch.nn.Module) or trainer= (a transformers Trainer)")
    check_model(model)
    if args is not None:
        check_args(args)
    if batch is not None:
        check_batch(batch)
        batch = dict(batch)  # a tokenizer's BatchEncoding is a mapping, not a dict
    if not isinstance(probe, bool):
        raise TypeError(f"probe must be True or False; got {type(probe).__name__}")
    hw = resolve_hardware(hardware)

    ctx = AuditContext(model=model, trainer=trainer, args=args, batch=batch, hardware=hw)
    extra: list[Finding] = []
    if probe:
        try:
            ctx.probe = run_probe(model, batch)
        except Exception as exc:  # the static rules still have something to say
            extra.append(Finding(
                rule="probe-error", severity=Severity.INFO, title="the activation probe could not run",
                detail=f"The probe forward pass raised {type(exc).__name__}: {exc}.",
                evidence={"exception": f"{type(exc).__name__}: {exc}"},
            ))
    result = AuditResult(findings=_run_rules(ctx) + extra, hardware=hw, probe=ctx.probe,
                         target="trainer" if trainer is not None else "model", with_args=args is not None)
    record_audit(result)
    return result


__all__ = ["AuditContext", "AuditResult", "ProbeResult", "RULES", "Rule", "rule", "run_audit", "run_probe"]
