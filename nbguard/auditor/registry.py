"""The rule registry: one small function per rule, registered with a stable id and a severity.

A rule takes the shared :class:`~nbguard.auditor.context.AuditContext` and returns ``None`` (it
does not apply) or a :class:`~nbguard.findings.Finding` (or a list of them). The decorator fills
in the id and default severity so a rule body only says what it saw.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from ..findings import Finding, Severity
from ..fixes import check_offered

_ID = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")


@dataclass(frozen=True)
class Rule:
    id: str
    severity: Severity
    check: Callable
    description: str


RULES: dict[str, Rule] = {}


def rule(rule_id: str, severity: str):
    """Register ``check(ctx)`` as rule ``rule_id`` (kebab-case, stable: users and tests refer to it)."""
    if not _ID.match(rule_id):
        raise ValueError(f"rule id {rule_id!r} must be kebab-case")

    def register(check: Callable) -> Callable:
        if rule_id in RULES:
            raise ValueError(f"rule {rule_id!r} is registered twice")
        RULES[rule_id] = Rule(rule_id, Severity(severity), check, (check.__doc__ or "").strip())
        check.rule_id = rule_id  # type: ignore[attr-defined]  # the id travels with the function
        return check

    return register


def finding(ctx_rule: str, title: str, detail: str, evidence: dict | None = None, fixes=(), severity=None) -> Finding:
    """A Finding for a registered rule; severity defaults to the rule's own."""
    sev = severity if severity is not None else RULES[ctx_rule].severity
    return Finding(rule=ctx_rule, severity=sev, title=title, detail=detail, evidence=evidence or {},
                   fixes=check_offered(list(fixes), f"audit rule {ctx_rule!r}"))


def capped(items, limit: int = 10) -> dict:
    """Evidence lists stay readable: the first ``limit`` items and how many there are in all."""
    items = list(items)
    return {"first": items[:limit], "count": len(items)}
