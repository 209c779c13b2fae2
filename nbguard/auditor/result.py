"""The result of an audit: findings worst first, the hardware, the probe, and fix cells."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .. import fixes
from ..environment import environment_info
from ..findings import Displayable, Finding, FixOffer, Severity, document, jsonable
from ..hardware import Hardware


@dataclass(repr=False)  # repr: through the output boundary (Displayable / dataclass_repr)
class AuditResult(Displayable):
    findings: list[Finding]
    hardware: Hardware
    probe: Any = None  # ProbeResult when the audit ran with probe=True
    target: str = "model"  # "trainer" when the audit was given a trainer: fix cells then use it
    with_args: bool = False  # TrainingArguments were audited: fix cells may change them
    with_optimizer: bool = False  # a plain loop's optimizer was audited: fix cells act on it
    environment: dict = field(default_factory=dict)
    verification: Any = None  # a Verification when the audit ran with verify=True
    stack: dict = field(default_factory=dict)  # quantization / unsloth / memory facts, as data

    def __post_init__(self) -> None:
        # Worst first; ties keep the registration order of the rules.
        self.findings = sorted(self.findings, key=lambda f: -Severity(f.severity).rank)

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == Severity.ERROR]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == Severity.WARNING]

    @property
    def rules(self) -> set[str]:
        return {f.rule for f in self.findings}

    def __contains__(self, rule_id: object) -> bool:
        return rule_id in self.rules

    def finding(self, rule_id: str) -> Finding | None:
        return next((f for f in self.findings if f.rule == rule_id), None)

    @property
    def fix_ids(self) -> list[str]:
        seen: list[str] = []
        for f in self.findings:
            seen += [x for x in f.fixes if x not in seen]
        return seen

    def offers(self) -> list[FixOffer]:
        """Every fix the findings offer, once, with the options chosen for it."""
        return [FixOffer(fix_id, self.fix_options(fix_id)) for fix_id in self.fix_ids]

    def fix_options(self, fix_id: str) -> dict:
        """Options the findings chose for a fix (e.g. switch-precision's target), else the fix's own for this hardware."""
        if fix_id == "switch-precision":
            offer = (self.stack.get("memory") or {}).get("offer")
            if offer is not None:  # fp32 does not fit this GPU: the partial variant (memory_offer.py)
                return dict(offer)
        return fixes.get(fix_id).options_for(self.hardware)

    def to_dict(self) -> dict[str, Any]:
        return {
            "hardware": self.hardware.to_dict(),
            "findings": [f.to_dict() for f in self.findings],
            "probe": self.probe.to_dict() if self.probe is not None else None,
            **({"stack": jsonable(self.stack)} if self.stack else {}),
        }

    def to_document(self, names: dict | None = None) -> dict[str, Any]:
        names = dict(names or {})
        if self.target == "trainer":
            names.setdefault("trainer", "trainer")
            names.pop("model", None)  # the trainer's model is what gets fixed
        else:
            names.setdefault("model", "model")
            if self.with_args:
                names.setdefault("args", "args")
            if self.with_optimizer:
                names.setdefault("optimizer", "optimizer")
        cells = {}
        for fix_id in self.fix_ids:
            fix = fixes.get(fix_id)
            cells[fix_id] = {"title": fix.title, "code": fixes.code(fix_id, **names, **self.fix_options(fix_id))}
        sections = dict(hardware=self.hardware.to_dict(), findings=[f.to_dict() for f in self.findings],
                        fix_cells=cells, title="nbguard precision audit")
        if self.probe is not None:
            sections["probe"] = self.probe.to_dict()
        if self.verification is not None:
            sections["verification"] = self.verification.to_dict()
        if self.stack:
            sections["stack"] = jsonable(self.stack)
        if not self.environment:
            self.environment = environment_info()
        sections["environment"] = jsonable(self.environment)
        return document("audit", **sections)
