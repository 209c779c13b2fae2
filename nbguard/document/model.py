"""The typed model of the nbguard v1 document: findings, watch events, their origins, the envelope.

Every result is a plain dataclass with ``to_dict()``/``from_dict()``; renderers read the dicts.
This package is the bottom layer of nbguard: it imports nothing else from nbguard.
"""
from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any, TypeVar

from .codec import decode_float, encode_float, jsonable

# The version every document is stamped with; nbguard/__init__.py and the build read it from here.
__version__ = "0.1.0"

MIME_TYPE = "application/vnd.nbguard.v1+json"
SCHEMA_VERSION = 1
T = TypeVar("T")


class Severity(str, enum.Enum):
    ERROR = "error"
    WARNING = "warning"
    INFO = "info"

    @property
    def rank(self) -> int:
        """Higher is worse; used to sort findings."""
        return {"info": 0, "warning": 1, "error": 2}[self.value]


@dataclass
class Finding:
    """One audit result: what rule fired, how bad it is, why, what was seen and how to fix it."""

    rule: str
    severity: Severity
    title: str
    detail: str
    evidence: dict[str, Any] = field(default_factory=dict)
    fixes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.severity = Severity(self.severity)

    def to_dict(self) -> dict[str, Any]:
        return {
            "rule": self.rule,
            "severity": self.severity.value,
            "title": self.title,
            "detail": self.detail,
            "evidence": jsonable(self.evidence),
            "fixes": list(self.fixes),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Finding:
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})


@dataclass
class Origin:
    """Where a non-finite value was born: a module, in forward or backward."""

    module: str
    phase: str  # "forward" or "backward"
    dtype: str | None = None
    input_absmax: float | None = None
    output_absmax: float | None = None
    tensor: str | None = None  # the output, gradient or parameter involved, e.g. "weight"
    micro_batch: int | None = None
    evidence: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["input_absmax"] = encode_float(self.input_absmax)
        data["output_absmax"] = encode_float(self.output_absmax)
        data["evidence"] = jsonable(self.evidence)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Origin:
        kwargs = {f.name: data[f.name] for f in fields(cls) if f.name in data}
        for key in ("input_absmax", "output_absmax"):
            if key in kwargs:
                kwargs[key] = decode_float(kwargs[key])
        return cls(**kwargs)


EVENT_KINDS = (
    "nonfinite-loss",
    "nonfinite-grad",
    "skipped-steps",
    "scaler-skip",  # one per step the GradScaler skipped; evidence.streak_start folds a streak for display
    "frozen-params",
    "frozen-eval-loss",
    "grad-spike",
    "few-supervised-tokens",
    "watch-error",
    # runs that stop learning without a NaN (nbguard.watcher.run_checks.EVENT_KINDS says what each means)
    "divergence",
    "dead-run",
    "nonfinite-reward",
    "no-learning-signal",
    "completions-truncated",
    "no-preference-signal",
    "ratio-mismatch",
)
CAUSES = (
    "overflow",
    "invalid-op",
    "nonfinite-parameter",
    "nonfinite-input",
    "no-supervised-tokens",
    "not-reproducible",
)


@dataclass
class Event:
    """Something the watch saw at one optimizer step (0-based, skipped steps counted)."""

    kind: str
    step: int
    message: str
    cause: str | None = None
    origins: list[Origin] = field(default_factory=list)
    evidence: dict[str, Any] = field(default_factory=dict)
    rank: int | None = None  # multi-rank runs: the rank it is about (the origin rank of a bad step)

    def __post_init__(self) -> None:
        if self.kind not in EVENT_KINDS:
            raise ValueError(f"unknown event kind {self.kind!r}; expected one of {EVENT_KINDS}")
        if self.cause is not None and self.cause not in CAUSES:
            raise ValueError(f"unknown cause {self.cause!r}; expected one of {CAUSES} or None")

    def origin(self, phase: str) -> Origin | None:
        """The first origin found in ``phase`` ("forward" or "backward"), if any."""
        return next((o for o in self.origins if o.phase == phase), None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "step": self.step,
            "message": self.message,
            "cause": self.cause,
            "origins": [o.to_dict() for o in self.origins],
            "evidence": jsonable(self.evidence),
            "rank": self.rank,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Event:
        return cls(
            kind=data["kind"],
            step=data["step"],
            message=data["message"],
            cause=data.get("cause"),
            origins=[Origin.from_dict(o) for o in data.get("origins", [])],
            evidence=data.get("evidence", {}),
            rank=data.get("rank"),
        )


def document(kind: str, **sections: Any) -> dict[str, Any]:
    """The envelope every nbguard payload shares (the MIME bundle data and the JSON report).

    ``kind`` names what is mainly inside ("audit", "watch", "diagnosis", "report");
    ``sections`` are already JSON-safe dicts/lists (``findings``, ``events``, ``history``, ...).
    """
    return {"schema_version": SCHEMA_VERSION, "kind": kind, "nbguard_version": __version__, **sections}


def fold_skip_streaks(events: list[T], read: Callable[[T], tuple[str, int, Any]]) -> list[tuple[T, int, int]]:
    """(first event, last step, count): the ``scaler-skip`` events of one GradScaler streak become one
    entry (the streak's first, localised event); every other event stands alone. ``read(event)``
    gives (kind, step, streak_start) for Event objects and document dicts alike."""
    folded: list[tuple[T, int, int]] = []
    open_streak: dict[Any, int] = {}  # streak_start -> index in folded
    for event in events:
        kind, step, start = read(event)
        start = start if kind == "scaler-skip" else None
        if start is not None and start in open_streak:
            index = open_streak[start]
            first, _, count = folded[index]
            folded[index] = (first, step, count + 1)
            continue
        if start is not None:
            open_streak[start] = len(folded)
        folded.append((event, step, 1))
    return folded
