"""A watch-side check after each training step: dropout layers left in eval mode while the model trains.

A small ``TrainerCallback``: ``on_step_end`` reads the modes (no tensor touched, no sync) and keeps
the first step where dropout was off, with the layers' names; it warns once. It plugs in as
``trainer.add_callback(DropoutModeCheck())`` or as a detector of the watch pipeline (``check(model,
step)`` returns the record or None).
"""
from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from ...document.outward import warn
from ...introspect.modes import dropout_in_eval


class DropoutModeCheck(TrainerCallback):
    """Records (and warns once about) training steps that ran with dropout layers in eval mode."""

    KEEP = 10  # records kept (the first steps); ``steps_with_dropout_off`` counts them all

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self.steps_with_dropout_off = 0

    def check(self, model: Any, step: int) -> dict[str, Any] | None:
        try:
            off = dropout_in_eval(model)
        except Exception:  # a check must never break the user's training
            return None
        if not off:
            return None
        record = {"step": step, "dropout_in_eval": off[:10], "count": len(off)}
        if not self.records:
            warn(f"nbguard: step {step} trained with {len(off)} dropout layer(s) in eval mode "
                 f"({', '.join(off[:3])}...): a wrapper's train() did not reach them", stacklevel=2)
        self.steps_with_dropout_off += 1
        if len(self.records) < self.KEEP:
            self.records.append(record)
        return record

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if model is not None:
            self.check(model, state.global_step)
