"""``nbguard.check_export``: the export rules over what :func:`export.measure` found, as one displayable result."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..findings import Finding, Severity, document, jsonable
from ..hardware import resolve_hardware
from ..session import record_audit
from .context import AuditContext
from .export import ExportFacts, measure
from .registry import RULES
from .result import AuditResult

EXPORT_FIXES = ("resave-adapter", "save-embedding-layers", "save-tokenizer", "merge-in-fp32")


@dataclass(repr=False)  # repr: through the output boundary (Displayable / dataclass_repr)
class ExportResult(AuditResult):
    """The export check's findings (worst first), the logit comparisons and the facts behind them."""

    facts: ExportFacts | None = None
    options: dict = field(default_factory=dict)  # what the fix cells write: path=, base=, dtype=

    @property
    def comparisons(self) -> dict:
        return dict(self.facts.comparisons) if self.facts is not None else {}

    def fix_options(self, fix_id: str) -> dict:
        if fix_id in EXPORT_FIXES:
            keys = {"merge-in-fp32": ("path", "base", "dtype")}.get(fix_id, ("path",))
            return {k: self.options[k] for k in keys if self.options.get(k) is not None}
        return super().fix_options(fix_id)

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "export": self.facts.to_dict() if self.facts is not None else None}

    def to_document(self, names: dict | None = None) -> dict[str, Any]:
        doc = super().to_document(names)
        doc["title"] = "nbguard export check" + (f": {self.facts.path}" if self.facts and self.facts.path else "")
        lines = [c.line() for c in self.comparisons.values()]
        if self.facts is not None:
            lines.append(f"probe batches: {self.facts.probe_source}; artifact: {self.facts.kind}"
                         + (f", loaded {jsonable(self.facts.load)}" if self.facts.load else ""))
        doc["notes"] = lines
        doc.setdefault("stack", {})["export"] = jsonable(self.facts.to_dict()) if self.facts is not None else None
        return document(doc.pop("kind"), **{k: v for k, v in doc.items() if k not in ("schema_version", "nbguard_version")})


def _run_export_rules(ctx: AuditContext) -> list[Finding]:
    found: list[Finding] = []
    for r in RULES.values():
        if not r.id.startswith("export-"):
            continue
        try:
            out = r.check(ctx)
        except Exception as exc:  # one broken rule must not hide what the others found
            found.append(Finding(rule="rule-error", severity=Severity.INFO, title=f"rule {r.id} could not run",
                                 detail=f"The rule {r.id} raised {type(exc).__name__}: {exc}.",
                                 evidence={"rule": r.id, "exception": f"{type(exc).__name__}: {exc}"}))
            continue
        if out is not None:
            found.extend(out if isinstance(out, list) else [out])
    return found


def _merge_options(facts: ExportFacts, model: Any) -> dict:
    base = facts.load.get("base")
    if base is None:
        peft_config = getattr(model, "peft_config", {}) or {}
        cfg = next(iter(peft_config.values()), None)
        base = getattr(cfg, "base_model_name_or_path", None)
    dtype = facts.trained_dtype if facts.trained_dtype in ("float32", "bfloat16", "float16") else None
    if facts.artifact_dtype in ("bfloat16", "float16"):
        dtype = facts.artifact_dtype  # serve in the dtype the user chose; only the merge goes through float32
    if not facts.base_quantized:
        # an unquantised base: cast back to a half dtype, the merged weights lose the update again
        dtype = "float32"
    return {"base": base or None, "dtype": dtype}


def run_export_check(model: Any, exported: Any, *, trainer: Any = None, tokenizer: Any = None, batch: Any = None,
                     base: Any = None) -> ExportResult:
    """Compare the trained model with the artifact exported from it; see ``nbguard.check_export``."""
    model, trainer, facts = measure(model, exported, trainer=trainer, tokenizer=tokenizer, batch=batch, base=base)
    ctx = AuditContext(model=model, trainer=trainer, args=getattr(trainer, "args", None))
    ctx.export = facts  # type: ignore[attr-defined]  # what the export rules read
    findings = _run_export_rules(ctx)
    options = {"path": facts.path or ("merged_dir" if facts.kind != "adapter" else None), **_merge_options(facts, model)}
    result = ExportResult(findings=findings, hardware=resolve_hardware(None), target="trainer" if trainer else "model",
                          facts=facts, options=options)
    record_audit(result)
    return result
