"""The fix registry: each fix is one definition with an action (apply) and a cell (code).

``apply(target, **options)`` changes the live objects and returns what it changed (empty when
there was nothing to do, which makes every fix idempotent). ``code(names, **options)`` returns the
notebook cell that has the same effect, written with the caller's variable names and plain
torch/transformers code so the user can keep it without nbguard.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass
class Target:
    """What a fix acts on: the model (the trainer's, when a trainer is given), the args, the trainer."""

    model: Any = None
    trainer: Any = None
    args: Any = None
    tokenizer: Any = None  # the tokenizer given, else the trainer's processing_class (data fixes)
    optimizer: Any = None  # a plain loop's optimizer (else the trainer's, once it built one)
    scaler: Any = None  # a plain loop's torch.amp.GradScaler, when it has one


@dataclass
class Names:
    """The caller's variable names (or expressions) for the objects a cell touches."""

    model: str = "model"
    trainer: str | None = None
    args: str | None = None  # None: no TrainingArguments in reach, so cells leave the args alone
    tokenizer: str = "tokenizer"
    optimizer: str | None = None  # a plain loop's optimizer: its cells act on it, never on args/trainer
    scaler: str | None = None  # a plain loop's GradScaler

    @property
    def loop(self) -> bool:
        """A plain PyTorch loop: no Trainer and no TrainingArguments to write a cell against."""
        return self.trainer is None and self.args is None


@dataclass(frozen=True)
class Need:
    """What a fix acts on, said two ways: to a notebook user, and as the keywords ``apply`` takes."""

    wanted: str
    keywords: str
    reached_by: frozenset[str]  # any one of these objects given is enough (a Trainer holds the rest)


NEEDS = {
    "model": Need("a model (torch.nn.Module) or a Trainer", "model= (or trainer=)", frozenset({"model", "trainer"})),
    "args": Need("TrainingArguments or a Trainer", "trainer= (or args=, a TrainingArguments)",
                 frozenset({"args", "trainer"})),
    "model-or-args": Need("a model, TrainingArguments or a Trainer", "model=, trainer= or args=",
                          frozenset({"model", "args", "trainer"})),
    "args-or-optimizer": Need("TrainingArguments, a Trainer, or a plain loop's optimizer",
                              "trainer=, args= (a TrainingArguments) or optimizer= (a torch optimizer)",
                              frozenset({"args", "trainer", "optimizer"})),
    "optimizer": Need("an optimizer (torch.optim.Optimizer) or a Trainer that built one",
                      "optimizer= (a torch.optim.Optimizer), or trainer= once it built its optimizer",
                      frozenset({"optimizer"})),
    "trainer": Need("a Trainer", "trainer= (a transformers Trainer)", frozenset({"trainer"})),
    "tokenizer": Need("a tokenizer or a Trainer", "tokenizer= (a transformers tokenizer), or trainer= with a "
                      "processing_class", frozenset({"tokenizer", "trainer"})),
}

# What a run holds, as ``Need.reached_by`` names it: a Trainer holds its args, optimizer and tokenizer; a plain
# loop holds its model and optimizer, and the notebook's tokenizer, by the names its cells use. A fix no object
# of the run reaches (drop-unsupervised-rows filters trainer.train_dataset) has no action and no cell there.
LOOP_HOLDS = frozenset({"model", "optimizer", "tokenizer"})
TRAINER_HOLDS = LOOP_HOLDS | {"trainer", "args"}


@dataclass(frozen=True)
class Fix:
    id: str
    title: str
    description: str
    apply: Callable[..., Any]  # apply(target: Target, **options) -> changes (falsy when none)
    code: Callable[..., str]  # code(names: Names, **options) -> notebook cell
    needs: str = "model"  # a key of NEEDS: what apply must be given
    # the options it is offered with where the offer does not say: options(hardware, fp16_in_use) -> dict
    default_options: Callable[..., dict[str, Any]] | None = None
    # its verification recipe: plan(step: CapturedStep, **options) -> ShadowPlan, or NotCheckable(why);
    # None: it cannot be run on a failing step (its verdict is "not checked", saying so)
    plan: Callable[..., Any] | None = None
    # the watch event causes it is offered for, and where it comes among them (lower first: the
    # automatic verification runs only the first few)
    treats: tuple[str, ...] = ()
    rank: int = 50
    # holds(step: CapturedStep, **options) -> why the run already does what the fix would do, else None:
    # a fix that already holds is not offered (a loop that clips at max_norm <= 1 gets no clipping fix)
    holds: Callable[..., str | None] | None = None

    def __post_init__(self) -> None:
        if self.needs not in NEEDS:
            raise ValueError(f"fix {self.id!r}: needs must be one of {', '.join(NEEDS)}; got {self.needs!r}")

    @property
    def need(self) -> Need:
        return NEEDS[self.needs]

    def reached_by(self, given: Iterable[str]) -> bool:
        """Whether the objects given (keys such as "model", "trainer") include what the fix acts on."""
        return bool(self.need.reached_by & set(given))

    def options_for(self, hardware: Any = None, fp16_in_use: bool = True) -> dict[str, Any]:
        """The options an offer of this fix carries by default, chosen for ``hardware`` (None: this machine)."""
        return dict(self.default_options(hardware, fp16_in_use)) if self.default_options is not None else {}


FIXES: dict[str, Fix] = {}


class CauseFixes(Mapping[str, list[str]]):
    """Event cause -> the ids of the fixes that treat it, most likely first (read off FIXES each time)."""

    def __getitem__(self, cause: str) -> list[str]:
        found = sorted((f for f in FIXES.values() if cause in f.treats), key=lambda f: f.rank)
        if not found:
            raise KeyError(cause)
        return [f.id for f in found]

    def __iter__(self) -> Iterator[str]:
        return iter(dict.fromkeys(c for f in FIXES.values() for c in f.treats))

    def __len__(self) -> int:
        return sum(1 for _ in self)


CAUSE_FIXES = CauseFixes()


def register(fix: Fix) -> Fix:
    if fix.id in FIXES:
        raise ValueError(f"fix {fix.id!r} is registered twice")
    FIXES[fix.id] = fix
    return fix
