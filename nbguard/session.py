"""What this kernel session recorded, for ``nbguard.report()`` with no arguments.

Kept deliberately small: the last audit, the watches, explained exceptions and applied fixes,
in the order they happened. Each producer calls ``record_*``; nothing here imports torch.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class SessionRecord:
    audits: list = field(default_factory=list)
    watches: list = field(default_factory=list)
    diagnoses: list = field(default_factory=list)
    fixes_applied: list[dict[str, Any]] = field(default_factory=list)

    @property
    def last_audit(self):
        return self.audits[-1] if self.audits else None

    def clear(self) -> None:
        self.audits.clear()
        self.watches.clear()
        self.diagnoses.clear()
        self.fixes_applied.clear()


SESSION = SessionRecord()


def record_audit(result) -> None:
    SESSION.audits.append(result)


def record_watch(watch) -> None:
    if not any(w is watch for w in SESSION.watches):
        SESSION.watches.append(watch)


def record_diagnosis(diagnosis) -> None:
    SESSION.diagnoses.append(diagnosis)


def record_fix(fix_id: str, changed: Any, code: str) -> None:
    SESSION.fixes_applied.append({"fix": fix_id, "changed": changed, "code": code, "time": time.time()})
