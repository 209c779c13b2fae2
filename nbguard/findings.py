"""The shared vocabulary of nbguard: findings, watch events and their origins.

Every result is a plain dataclass with ``to_dict()``; rendering (text, HTML, the
``application/vnd.nbguard.v1+json`` bundle, widgets) lives elsewhere and reads this data.
Non-finite floats are written to JSON as the strings ``"nan"``, ``"inf"`` and ``"-inf"``
because JSON has no spelling for them.
"""
from __future__ import annotations

import enum
import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

MIME_TYPE = "application/vnd.nbguard.v1+json"
SCHEMA_VERSION = 1


class Severity(str, enum.Enum):
    ERROR = "error"
    WARNING = "warning"
    INFO = "info"

    @property
    def rank(self) -> int:
        """Higher is worse; used to sort findings."""
        return {"info": 0, "warning": 1, "error": 2}[self.value]


def encode_float(value: float | None) -> float | str | None:
    """A float as JSON can carry it: non-finite values become strings."""
    if value is None:
        return None
    value = float(value)
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return value


def decode_float(value: float | str | None) -> float | None:
    """The inverse of :func:`encode_float`."""
    if value is None:
        return None
    if isinstance(value, str):
        return float(value)  # float("nan"), float("inf"), float("-inf")
    return float(value)


def jsonable(value: Any) -> Any:
    """Recursively turn evidence values into JSON-safe data (floats encoded, tuples to lists)."""
    if isinstance(value, float):
        return encode_float(value)
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [jsonable(v) for v in value]
    if value is None or isinstance(value, (str, int, bool)):
        return value
    if hasattr(value, "to_dict"):
        return value.to_dict()
    return str(value)  # dtypes, devices, versions: their printed form is what a reader wants


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
    "frozen-params",
    "frozen-eval-loss",
    "grad-spike",
    "watch-error",
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
    from . import __version__

    return {"schema_version": SCHEMA_VERSION, "kind": kind, "nbguard_version": __version__, **sections}


class Displayable:
    """Mixin for result objects: they show themselves anywhere IPython can display.

    Subclasses implement ``to_document()`` returning a :func:`document`; the renderers
    (``nbguard.render``) turn it into ``text/plain``, ``text/html`` and the nbguard MIME data.
    """

    def to_document(self) -> dict[str, Any]:  # pragma: no cover - abstract
        raise NotImplementedError

    def _repr_mimebundle_(self, include=None, exclude=None):
        from .render import mime_bundle

        return mime_bundle(self.to_document())

    def __str__(self) -> str:
        from .render import render_text

        return render_text(self.to_document())
