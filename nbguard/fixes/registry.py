"""The fix registry: each fix is one definition with an action (apply) and a cell (code).

``apply(target, **options)`` changes the live objects and returns what it changed (empty when
there was nothing to do, which makes every fix idempotent). ``code(names, **options)`` returns the
notebook cell that has the same effect, written with the caller's variable names and plain
torch/transformers code so the user can keep it without nbguard.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class Target:
    """What a fix acts on: the model (the trainer's, when a trainer is given), the args, the trainer."""

    model: Any = None
    trainer: Any = None
    args: Any = None
    tokenizer: Any = None  # the tokenizer given, else the trainer's processing_class (data fixes)


@dataclass
class Names:
    """The caller's variable names (or expressions) for the objects a cell touches."""

    model: str = "model"
    trainer: str | None = None
    args: str | None = None  # None: no TrainingArguments in reach, so cells leave the args alone
    tokenizer: str = "tokenizer"


@dataclass(frozen=True)
class Fix:
    id: str
    title: str
    description: str
    apply: Callable[..., Any]  # apply(target: Target, **options) -> changes (falsy when none)
    code: Callable[..., str]  # code(names: Names, **options) -> notebook cell
    needs: str = "model"  # "model", "args", "model-or-args", "trainer" or "tokenizer": what apply must be given


FIXES: dict[str, Fix] = {}


def register(fix: Fix) -> Fix:
    if fix.id in FIXES:
        raise ValueError(f"fix {fix.id!r} is registered twice")
    FIXES[fix.id] = fix
    return fix
