"""The precision audit: rules over model, trainer, args, batch and hardware, and the activation probe.

``run_audit`` builds one :class:`AuditContext` of lazily computed facts, runs every registered
rule against it (a failing rule becomes an info finding, never a failed audit) and returns an
:class:`AuditResult`.
"""
from __future__ import annotations

from ..findings import Finding, Severity
from ..hardware import resolve_hardware
from ..introspect.inputs import check_batch, is_trainer
from ..session import SESSION, record_audit
from ..step.targets import resolve_targets
from . import rules as _rules  # noqa: F401  (registers every rule)
from .context import AuditContext
from .loop_objects import check_loop_objects
from .memory_offer import memory_facts, memory_note
from .probe import ProbeResult, run_probe
from .registry import RULES, Rule, rule
from .result import AuditResult
from .resume import read_checkpoint, resolve_checkpoint


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


def stack_facts(ctx: AuditContext) -> tuple[dict, list[Finding]]:
    """The quantization, Unsloth and memory facts the audit read (for the document even when no
    rule fired), and an info finding per fact that could not be read (the audit goes on)."""
    facts: dict = {}
    failed: list[Finding] = []
    readers = (("quantization", lambda: ctx.quantization.to_dict() if ctx.quantization.any else None),
               ("unsloth", lambda: ctx.unsloth.to_dict() if ctx.unsloth.any else None),
               ("memory", lambda: memory_facts(ctx)))
    for name, read in readers:
        try:
            value = read()
        except Exception as exc:  # one unreadable fact must not hide the findings
            failed.append(Finding(
                rule="facts-error", severity=Severity.INFO, title=f"the {name} facts could not be read",
                detail=f"Reading the {name} facts raised {type(exc).__name__}: {exc}. The rules ran normally.",
                evidence={"facts": name, "exception": f"{type(exc).__name__}: {exc}"},
            ))
            continue
        if value is not None:
            facts[name] = value
    return facts, failed


def _note_memory(findings: list[Finding], stack: dict) -> None:
    """Findings that offer switch-precision show the estimate that decides what it does here."""
    memory = stack.get("memory")
    if memory is None or memory.get("target_fits") is not False:  # it fits: the full switch, as always
        return
    for f in findings:
        if "switch-precision" in f.fixes:
            f.evidence["memory"] = memory_note(memory)


def _unsloth_fixes(findings: list[Finding]) -> None:
    """On an Unsloth setup the precision fix is Unsloth's own (reload with dtype=, its trainer
    flags): switch-precision would cast weights and rebuild the accelerator behind Unsloth's back."""
    for f in findings:
        if "switch-precision" in f.fixes:
            f.fixes = ["unsloth-precision" if x == "switch-precision" else x for x in f.fixes]


def run_audit(model=None, trainer=None, *, args=None, batch=None, hardware=None, probe=False,
              resume_from_checkpoint=None, optimizer=None, scaler=None) -> AuditResult:
    """Audit a fine-tuning setup; see ``nbguard.audit``."""
    if trainer is None and is_trainer(model):  # nbguard.audit(trainer), as nbguard.watch(trainer) takes it
        model, trainer = None, model
    model, args, _ = resolve_targets(trainer, model, args)
    if model is None:
        raise ValueError("nbguard.audit needs model= (a torch.nn.Module) or trainer= (a transformers Trainer)")
    if batch is not None:
        check_batch(batch)
        batch = dict(batch)  # a tokenizer's BatchEncoding is a mapping, not a dict
    if not isinstance(probe, bool):
        raise TypeError(f"probe must be True or False; got {type(probe).__name__}")
    check_loop_objects(optimizer, scaler)
    hw = resolve_hardware(hardware)
    # the latest audit names the session's target: the machine the user named (fixes are chosen and verified
    # for it), or none, and then this machine is the target
    SESSION.target_hardware = hw if hardware is not None else None

    ctx = AuditContext(model=model, trainer=trainer, args=args, batch=batch, hardware=hw, optimizer=optimizer,
                       scaler=scaler)
    if resume_from_checkpoint is not None and resume_from_checkpoint is not False:
        ctx.resume = read_checkpoint(resolve_checkpoint(resume_from_checkpoint, args), args, hw)  # type: ignore[attr-defined]
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
    findings = _run_rules(ctx) + extra
    stack, failed = stack_facts(ctx)
    findings += failed
    _note_memory(findings, stack)
    if "unsloth" in stack:
        _unsloth_fixes(findings)
    result = AuditResult(findings=findings, hardware=hw, probe=ctx.probe,
                         target="trainer" if trainer is not None else "model", with_args=args is not None,
                         stack=stack, with_optimizer=optimizer is not None)
    record_audit(result)
    return result


__all__ = ["AuditContext", "AuditResult", "ProbeResult", "RULES", "Rule", "rule", "run_audit", "run_probe"]
