"""What this kernel session recorded, in the order it happened, for ``nbguard.report()``.

Each producer calls ``record_*``; the timeline keeps one entry per audit, watch, fix applied,
explained exception and verification, so a report can tell the story: the audit before a fix, the
fix, the audit after it. Nothing here imports torch.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from .document import document


@dataclass
class Entry:
    kind: str  # "audit", "watch", "fix", "diagnosis", "verification"
    time: float
    value: Any  # a result object with to_document(), or a fix record (dict)

    def document(self) -> dict:
        if self.kind == "fix":
            doc = document("fix", fixes_applied=[dict(self.value)])
        elif isinstance(self.value, dict) and "schema_version" in self.value:  # recorded as a document
            doc = self.value
        elif callable(getattr(self.value, "to_document", None)):
            doc = self.value.to_document()
        else:
            doc = document("diagnosis", diagnoses=[self.value.to_dict()])
        return {**doc, "time": self.time}


@dataclass
class SessionRecord:
    timeline: list[Entry] = field(default_factory=list)

    def _values(self, kind: str) -> list:
        return [e.value for e in self.timeline if e.kind == kind]

    @property
    def audits(self) -> list:
        return self._values("audit")

    @property
    def watches(self) -> list:
        return self._values("watch")

    @property
    def diagnoses(self) -> list:
        return self._values("diagnosis")

    @property
    def fixes_applied(self) -> list[dict[str, Any]]:
        return self._values("fix")

    @property
    def last_audit(self):
        audits = self.audits
        return audits[-1] if audits else None

    def documents(self) -> list[dict]:
        """Every entry's document, in the order they happened (each carries its ``time``)."""
        return [entry.document() for entry in self.timeline]

    def clear(self) -> None:
        self.timeline.clear()


SESSION = SessionRecord()


def _record(kind: str, value: Any) -> None:
    SESSION.timeline.append(Entry(kind, time.time(), value))


def record_audit(result) -> None:
    _record("audit", result)


def record_watch(watch) -> None:
    if not any(e.value is watch for e in SESSION.timeline):
        _record("watch", watch)


def record_diagnosis(diagnosis) -> None:
    _record("diagnosis", diagnosis)


def record_verification(verification) -> None:
    _record("verification", verification)


def record_fix(fix_id: str, changed: Any, code: str) -> None:
    now = time.time()
    SESSION.timeline.append(Entry("fix", now, {"fix": fix_id, "changed": changed, "code": code, "time": now}))
