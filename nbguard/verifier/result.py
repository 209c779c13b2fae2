"""What verifying fixes found, as data: one verdict per candidate fix, ranked, with its evidence.

A verdict is "verified" (the failing step is healthy under the fix), "not enough" (still
non-finite, and where) or "not checked" (and why). A data or config fix is judged by a re-audit instead
(``FixVerdict.reaudit``): its rules re-run on a shadow of the trainer as built, no step. ``Verification.to_document()`` is the v1
document the renderers read; ``str()`` is a plain-text view for a script user.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..document.outward import dataclass_repr, outward_text
from ..findings import Displayable, decode_float, document, encode_float, jsonable

VERIFIED = "verified"
NOT_ENOUGH = "not enough"
NOT_CHECKED = "not checked"
VERDICTS = (VERIFIED, NOT_ENOUGH, NOT_CHECKED)  # also the ranking order


@dataclass(repr=False)  # repr: through the output boundary (Displayable / dataclass_repr)
class StepEvidence:
    """What one shadow run of the step measured."""
    __repr__ = dataclass_repr

    loss: float | None = None
    total_grad_norm: float | None = None
    grads_finite: bool | None = None  # None: no backward ran
    largest_activation: float | None = None
    largest_activation_at: str | None = None
    first_nonfinite: str | None = None  # "forward: <module>" or "gradient: <parameter>", when not healthy
    nonfinite_grads: list[str] = field(default_factory=list)  # first few parameter names
    precision: str = ""
    seconds: float = 0.0
    micro_batches: int = 0
    supervised_tokens: int | None = None  # labels the loss is computed over (None: no labels reached the model)

    @property
    def healthy(self) -> bool:
        loss_ok = self.loss is None or self.loss == self.loss and abs(self.loss) != float("inf")
        return loss_ok and self.grads_finite is not False and self.first_nonfinite is None

    def to_dict(self) -> dict[str, Any]:
        return {"loss": encode_float(self.loss), "total_grad_norm": encode_float(self.total_grad_norm),
                "grads_finite": self.grads_finite, "largest_activation": encode_float(self.largest_activation),
                "largest_activation_at": self.largest_activation_at, "first_nonfinite": self.first_nonfinite,
                "nonfinite_grads": list(self.nonfinite_grads), "precision": self.precision,
                "seconds": self.seconds, "micro_batches": self.micro_batches,
                "supervised_tokens": self.supervised_tokens, "healthy": self.healthy}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepEvidence:
        return cls(loss=decode_float(data.get("loss")), total_grad_norm=decode_float(data.get("total_grad_norm")),
                   grads_finite=data.get("grads_finite"),
                   largest_activation=decode_float(data.get("largest_activation")),
                   largest_activation_at=data.get("largest_activation_at"),
                   first_nonfinite=data.get("first_nonfinite"), nonfinite_grads=list(data.get("nonfinite_grads", [])),
                   precision=data.get("precision", ""), seconds=float(data.get("seconds", 0.0)),
                   micro_batches=int(data.get("micro_batches", 0)), supervised_tokens=data.get("supervised_tokens"))


@dataclass(repr=False)  # repr: through the output boundary (Displayable / dataclass_repr)
class ModuleEvidence:
    """The origin module re-run alone on its captured inputs under one fix."""
    __repr__ = dataclass_repr

    module: str
    dtype: str | None
    absmax: float | None
    finite: bool

    def to_dict(self) -> dict[str, Any]:
        return {"module": self.module, "dtype": self.dtype, "absmax": encode_float(self.absmax), "finite": self.finite}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModuleEvidence:
        return cls(data["module"], data.get("dtype"), decode_float(data.get("absmax")), bool(data.get("finite")))


@dataclass(repr=False)  # repr: through the output boundary (Displayable / dataclass_repr)
class ModuleCheck:
    """The origin module's output in full precision, and which dtypes it fits."""
    __repr__ = dataclass_repr

    module: str
    phase: str
    reference_absmax: float | None = None  # float32 abs-max of the module's output on its captured inputs
    fits: dict[str, bool] = field(default_factory=dict)  # dtype name -> the output fits its range
    seconds: float = 0.0
    skipped: str | None = None  # why the module-level check did not run

    @property
    def summary(self) -> str:
        if self.skipped:
            return f"module level not run: {self.skipped}"
        short = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}
        fit = [short.get(d, d) for d, ok in self.fits.items() if ok]
        over = [short.get(d, d) for d, ok in self.fits.items() if not ok]
        if self.reference_absmax is None:
            return f"{self.module}: non-finite even in fp32 (not a range problem: an invalid operation or input)"
        text = f"{self.module}: abs-max {self.reference_absmax:.3g} in fp32"
        if over:
            text += ": overflows " + " and ".join(over)
            text += (", fits " + " and ".join(fit)) if fit else ""
        elif fit:
            text += ": fits " + ", ".join(fit)
        return text

    def to_dict(self) -> dict[str, Any]:
        return {"module": self.module, "phase": self.phase, "reference_absmax": encode_float(self.reference_absmax),
                "fits": dict(self.fits), "seconds": self.seconds, "skipped": self.skipped, "summary": self.summary}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModuleCheck:
        return cls(data["module"], data.get("phase", "forward"), decode_float(data.get("reference_absmax")),
                   dict(data.get("fits", {})), float(data.get("seconds", 0.0)), data.get("skipped"))


@dataclass(repr=False)  # repr: through the output boundary (Displayable / dataclass_repr)
class FixVerdict:
    """One candidate fix on the failing step."""
    __repr__ = dataclass_repr

    fix: str
    verdict: str  # one of VERDICTS
    reason: str  # one sentence: why this verdict
    options: dict[str, Any] = field(default_factory=dict)
    title: str = ""
    code: str | None = None  # the exact cell that was verified
    step: StepEvidence | None = None  # None: the step level did not run for this fix
    module: ModuleEvidence | None = None
    changes: dict[str, Any] = field(default_factory=dict)  # what the shadow changed (tensor names -> what)
    # a data or config fix checked by re-running its rules on a shadow of the trainer (no step ran): the rules,
    # the batches they read, and the findings that still fire (reaudit.py)
    reaudit: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"unknown verdict {self.verdict!r}; expected one of {VERDICTS}")

    @property
    def rank(self) -> int:
        return VERDICTS.index(self.verdict)

    def to_dict(self) -> dict[str, Any]:
        return {"fix": self.fix, "verdict": self.verdict, "reason": self.reason, "options": jsonable(self.options),
                "title": self.title, "code": self.code, "step": self.step.to_dict() if self.step else None,
                "module": self.module.to_dict() if self.module else None, "changes": jsonable(self.changes),
                "reaudit": jsonable(self.reaudit) if self.reaudit is not None else None}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FixVerdict:
        return cls(fix=data["fix"], verdict=data["verdict"], reason=data.get("reason", ""),
                   options=dict(data.get("options") or {}), title=data.get("title", ""), code=data.get("code"),
                   step=StepEvidence.from_dict(data["step"]) if data.get("step") else None,
                   module=ModuleEvidence.from_dict(data["module"]) if data.get("module") else None,
                   changes=dict(data.get("changes") or {}),
                   reaudit=dict(data["reaudit"]) if isinstance(data.get("reaudit"), dict) else None)


@dataclass(repr=False)  # repr: through the output boundary (Displayable / dataclass_repr)
class Verification(Displayable):
    """Every candidate fix for one event or finding, verified first, then not enough, then not checked."""

    subject: str  # what was verified, e.g. "event step 0 nonfinite-grad" or "audit finding zero-embedding-rows"
    verdicts: list[FixVerdict] = field(default_factory=list)
    baseline: StepEvidence | None = None  # the step without any fix, when it was run
    module_check: ModuleCheck | None = None
    step_level: bool = True  # False: the whole step was skipped (see step_skipped)
    step_skipped: str | None = None
    memory: dict[str, Any] = field(default_factory=dict)  # estimate and budget, in bytes
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.verdicts = sorted(self.verdicts, key=lambda v: v.rank)  # stable: candidate order within a rank

    def verdict(self, fix_id: str) -> FixVerdict | None:
        return next((v for v in self.verdicts if v.fix == fix_id), None)

    @property
    def verified(self) -> list[str]:
        return [v.fix for v in self.verdicts if v.verdict == VERIFIED]

    def to_dict(self) -> dict[str, Any]:
        return {"subject": self.subject, "verdicts": [v.to_dict() for v in self.verdicts],
                "baseline": self.baseline.to_dict() if self.baseline else None,
                "module_check": self.module_check.to_dict() if self.module_check else None,
                "step_level": self.step_level, "step_skipped": self.step_skipped, "memory": jsonable(self.memory),
                "seconds": self.seconds, "notes": list(self.notes)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Verification:
        return cls(subject=data.get("subject", ""), verdicts=[FixVerdict.from_dict(v) for v in data.get("verdicts", [])],
                   baseline=StepEvidence.from_dict(data["baseline"]) if data.get("baseline") else None,
                   module_check=ModuleCheck.from_dict(data["module_check"]) if data.get("module_check") else None,
                   step_level=bool(data.get("step_level", True)), step_skipped=data.get("step_skipped"),
                   memory=dict(data.get("memory") or {}), seconds=float(data.get("seconds", 0.0)),
                   notes=list(data.get("notes", [])))

    def to_document(self) -> dict[str, Any]:
        return document("verification", title=f"nbguard verified fixes: {self.subject}", verification=self.to_dict())

    def __str__(self) -> str:
        lines = [f"nbguard verified fixes: {self.subject}"]
        if self.module_check is not None:
            lines.append(f"  {self.module_check.summary}")
        if self.step_skipped:
            lines.append(f"  step level skipped: {self.step_skipped}")
        elif self.baseline is not None:
            lines.append(f"  without a fix: {_step_line(self.baseline)}")
        for v in self.verdicts:
            option = "".join(f" {k}={val}" for k, val in v.options.items())
            lines.append(f"  [{v.verdict}] {v.fix}{option}: {v.reason}")
            if v.step is not None:
                lines.append(f"      {_step_line(v.step)}")
            if v.module is not None:
                absmax = "nan" if v.module.absmax is None else f"{v.module.absmax:.3g}"
                lines.append(f"      module {v.module.module} ({v.module.dtype}): abs-max {absmax}, "
                             f"{'finite' if v.module.finite else 'non-finite'}")
        for note in self.notes:
            lines.append(f"  note: {note}")
        return outward_text("\n".join(lines))  # a reason or note can quote an exception's message


def _step_line(s: StepEvidence) -> str:
    def num(x: float | None) -> str:
        return "-" if x is None else f"{x:.4g}"

    text = f"loss {num(s.loss)}, grad norm {num(s.total_grad_norm)}, "
    text += "grads finite" if s.grads_finite else ("no backward" if s.grads_finite is None else "grads NOT finite")
    if s.largest_activation is not None:
        text += f", largest activation {num(s.largest_activation)} at {s.largest_activation_at}"
    if s.first_nonfinite:
        text += f", first non-finite: {s.first_nonfinite}"
    return text + f" [{s.precision}; {s.seconds:.2f} s]"
