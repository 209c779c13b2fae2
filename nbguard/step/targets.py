"""What a Trainer hands a step: its model, its args and its optimizer, unless the caller gave their own."""
from __future__ import annotations

from typing import Any, NamedTuple

from ..introspect.inputs import check_args, check_model, check_trainer


class StepTargets(NamedTuple):
    model: Any
    args: Any
    optimizer: Any


def resolve_targets(trainer: Any = None, model: Any = None, args: Any = None, optimizer: Any = None) -> StepTargets:
    """The trainer's model, args and optimizer where the caller gave none, each checked for its type."""
    if trainer is not None:
        check_trainer(trainer)
        model = trainer.model if model is None else model
        args = trainer.args if args is None else args
        optimizer = getattr(trainer, "optimizer", None) if optimizer is None else optimizer
    if model is not None:
        check_model(model)
    if args is not None:
        check_args(args)
    return StepTargets(model, args, optimizer)
