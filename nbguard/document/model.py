"""The typed model of the nbguard v1 document: findings, watch events, their origins, the envelope.

Every result is a plain dataclass with ``to_dict()``/``from_dict()``; renderers read the dicts.
This package is the bottom layer of nbguard: it imports nothing else from nbguard.
"""
from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any, TypeVar

from .codec import decode_float, encode_float, jsonable
from .outward import outward_text

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


@dataclass(frozen=True)
class FixOffer:
    """A fix a finding, an event or a diagnosis offers: a registered fix id and the options it comes with."""

    id: str
    options: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"fix": self.id, "options": jsonable(self.options)}


def _clip(text: Any, width: int = 100) -> str:
    """One line of at most ``width`` characters (reprs stay a few lines; to_dict() has everything),
    redacted whole before it is cut: a repr in a cell's output is saved in the notebook."""
    line = " ".join(outward_text(text).split())
    return line if len(line) <= width else line[:width - 1] + "…"


def _keys(evidence: dict[str, Any]) -> str:
    return f"  evidence: {', '.join(map(str, evidence))} (in .to_dict())" if evidence else ""


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

    def __repr__(self) -> str:
        lines = [f"Finding({self.severity.value} {self.rule}: {_clip(self.title)})", f"  {_clip(self.detail)}"]
        if self.fixes:
            lines.append(f"  fixes: {', '.join(self.fixes)}")
        return outward_text("\n".join(filter(None, [*lines, _keys(self.evidence)])))

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

    def __repr__(self) -> str:
        where = f"{self.module}" + (f".{self.tensor}" if self.tensor else "")
        sizes = ", ".join(f"{k} {v:.4g}" for k, v in (("input abs-max", self.input_absmax),
                                                      ("output abs-max", self.output_absmax)) if v is not None)
        return outward_text(f"Origin({self.phase} {where}" + (f" [{self.dtype}]" if self.dtype else "")
                            + (f", {sizes})" if sizes else ")"))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Origin:
        kwargs = {f.name: data[f.name] for f in fields(cls) if f.name in data}
        for key in ("input_absmax", "output_absmax"):
            if key in kwargs:
                kwargs[key] = decode_float(kwargs[key])
        return cls(**kwargs)


@dataclass(frozen=True)
class EventKind:
    """One registered event kind: what it means (one line) and the evidence keys it carries."""

    kind: str
    description: str
    evidence: tuple[str, ...] = ()


# The one registry of event kinds: Event validation, the schema, the docs and the views read it.
EVENT_KIND_REGISTRY: dict[str, EventKind] = {}


def register_event_kind(kind: str, description: str, evidence: tuple[str, ...] | list[str] = ()) -> EventKind:
    """Register an event kind once (a detector's module does it at import). Registering the same
    kind again with the same description is a no-op; a different one is an error. nbguard's own kinds
    are written into schema.json and the Lab extension's types by labextension/scripts/write_schemas.py."""
    if not isinstance(kind, str) or not kind or kind != kind.strip().lower() or " " in kind:
        raise ValueError(f"event kind must be a short lower-case name like 'grad-spike', got {kind!r}")
    if not isinstance(description, str) or not description.strip():
        raise ValueError(f"register_event_kind({kind!r}): description must be a one-line sentence")
    entry = EventKind(kind, description.strip(), tuple(evidence))
    known = EVENT_KIND_REGISTRY.get(kind)
    if known is not None and known.description != entry.description:
        raise ValueError(f"event kind {kind!r} is already registered as {known.description!r}")
    EVENT_KIND_REGISTRY[kind] = entry
    return entry


class _KindNames(Sequence[str]):
    """``EVENT_KINDS``: the registered kinds' names, live (kinds registered later appear)."""

    def __getitem__(self, index):
        return tuple(EVENT_KIND_REGISTRY)[index]

    def __len__(self) -> int:
        return len(EVENT_KIND_REGISTRY)

    def __contains__(self, kind: object) -> bool:
        return kind in EVENT_KIND_REGISTRY

    def __repr__(self) -> str:
        return outward_text(repr(tuple(EVENT_KIND_REGISTRY)))


EVENT_KINDS: Sequence[str] = _KindNames()

for _kind, _description, _evidence in (
    ("nonfinite-loss", "the step's loss is NaN/Inf", ("loss", "total_grad_norm", "nonfinite_groups")),
    ("nonfinite-grad", "a gradient is NaN/Inf while the loss is finite (or was not read)", ("loss", "total_grad_norm",
                                                                          "nonfinite_groups")),
    ("skipped-steps", "the GradScaler skipped many optimizer steps in a row or its scale collapsed",
     ("consecutive_skipped", "skipped_total", "streak_start", "scale_trend", "scale_collapsed")),
    ("scaler-skip", "the GradScaler skipped this step (evidence.streak_start folds a streak for display)",
     ("streak_start", "loss_scale")),
    ("frozen-params", "trainable weights stayed bit-identical over many optimizer steps",
     ("unchanged_since_step", "checked_at_step", "steps_unchanged")),
    ("frozen-eval-loss", "the eval loss is bit-identical across evaluations", ("eval_loss", "evaluations")),
    ("grad-spike", "the total gradient norm spiked far above its recent median (older documents: the "
                   "watch now judges spikes as divergence events)",
     ("total_grad_norm", "recent_median", "ratio", "largest_group")),
    ("few-supervised-tokens", "a micro-batch's loss rests on few (or no) supervised tokens",
     ("micro_batch", "supervised_tokens", "recent_median", "occurrences", "steps")),
    ("divergence", "the gradient norm jumped far outside the run's own noise (log scale, robust statistics), or "
                   "the loss climbed past where the run started with the gradient norm rising",
     ("level", "noise", "largest_groups")),
    ("dead-run", "the gradient norm is exactly 0, or the loss bit-identical, for several steps in a row", ()),
    ("update-spike", "the optimizer's update (||Δw|| / ||w||) jumped far above the run's own level: an early "
                     "warning, a step before the loss sees the damaged weights", ("update_ratio", "recent_level",
                                                                                   "ratio", "largest_groups",
                                                                                   "sample_parts")),
    ("nonfinite-reward", "a GRPO/RLOO reward function returned inf, -inf or NaN", ()),
    ("no-learning-signal", "every group of completions got equal rewards: zero advantage, zero gradient", ()),
    ("completions-truncated", "every completion was cut at max_completion_length", ()),
    ("no-preference-signal", "DPO/KTO margins stay exactly 0, or the loss is ~0 from the first step", ()),
    ("ratio-mismatch", "tokens clipped on GRPO's first inner step, where the policy/old-policy ratio must be 1", ()),
    ("policy-collapse", "a GRPO/RLOO policy's entropy or completion length collapsed while its reward stayed flat",
     ("reason", "fraction", "reward_early", "reward_now")),
    ("kl-at-start", "the KL to the reference is far from 0 on step 0, where the policy is the reference",
     ("kl", "beta", "differs_in")),
    ("rank-token-imbalance", "DDP ranks' mean losses weigh their tokens unequally (uneven supervised tokens "
     "per rank, losses not normalised across ranks)", ("tokens_by_rank", "ratio", "occurrences")),
    ("watch-error", "nbguard's own watch failed and stepped aside; training went on", ("exception",)),
):
    register_event_kind(_kind, _description, _evidence)

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
            raise ValueError(f"unknown event kind {self.kind!r}; expected one of {EVENT_KINDS} "
                             f"(a new kind is registered with register_event_kind)")
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

    def __repr__(self) -> str:
        head = f"Event({self.kind} at step {self.step}" + (f" on rank {self.rank}" if self.rank is not None else "")
        head += f", cause {self.cause})" if self.cause else ")"
        lines = [head, f"  {_clip(self.message)}"]
        if self.origins:
            more = f" (+{len(self.origins) - 1} more)" if len(self.origins) > 1 else ""
            lines.append(f"  origin: {self.origins[0]!r}{more}")
        return outward_text("\n".join(filter(None, [*lines, _keys(self.evidence)])))

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
