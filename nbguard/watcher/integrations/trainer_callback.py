"""A ``TrainerCallback`` that watches the Trainer it is handed to, for code that builds the Trainer itself
and never returns it (LLaMA-Factory's ``run_exp(callbacks=[...])``, an axolotl plugin's callbacks).

A callback's events carry the model, optimizer and scheduler but never the Trainer. The Trainer is
found where transformers calls the event: ``CallbackHandler.call_event`` runs inside a method of the
Trainer (``__init__`` for ``on_init_end``, the training loop for ``on_train_begin``), so the call stack
holds it as ``self``. A candidate is accepted only by identity: its handler holds this very callback
and its ``state`` is the state the event was given, so no other Trainer on the stack can be taken.
"""
from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

from transformers import TrainerCallback

from ...document.outward import outward_text, warn


def calling_trainer(callback: Any, state: Any) -> Any:
    """The Trainer whose callback handler is calling ``callback`` with ``state`` now, or None."""
    trainer_type = getattr(sys.modules.get("transformers.trainer"), "Trainer", None)
    if trainer_type is None:
        return None
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, trainer_type) and getattr(candidate, "state", None) is state:
            handler = getattr(candidate, "callback_handler", None)
            if any(held is callback for held in getattr(handler, "callbacks", ())):
                return candidate
        frame = frame.f_back
    return None


class AttachOnInit(TrainerCallback):
    """Attaches ``attach(trainer)`` (``nbguard.watch`` with the options given to ``nbguard.callback``) to
    the Trainer this callback is given to: when the Trainer is built (``on_init_end``), or at the start
    of training when the callback was added later (``trainer.add_callback``). ``watch`` is the watch,
    once attached (a watch you detach stays detached); a callback handed to a second Trainer watches
    that one from then on."""

    def __init__(self, attach: Callable[[Any], Any]):
        self._attach = attach
        self.watch: Any = None

    def on_init_end(self, args, state, control, **kwargs):
        self._attach_to(calling_trainer(self, state))

    def on_train_begin(self, args, state, control, **kwargs):
        # added after the Trainer was built (on_init_end never reached it), or handed to another Trainer.
        # The watch this attaches is appended to the handler's list now, so its on_train_begin still runs.
        trainer = calling_trainer(self, state)
        if self.watch is None or self.watch.trainer is not trainer:
            self._attach_to(trainer)

    def _attach_to(self, trainer: Any) -> None:
        if trainer is None:  # never the user's run's failure: it trains on, unwatched, and is told so
            warn("nbguard.callback() found no transformers Trainer calling it, so nothing is watched: pass it "
                 "in a Trainer's callbacks=[...] or trainer.add_callback(...)", RuntimeWarning, stacklevel=3)
            return
        self.watch = self._attach(trainer)

    def __repr__(self) -> str:
        watched = type(self.watch.trainer).__name__ if self.watch is not None else "no Trainer yet"
        return outward_text(f"<nbguard callback: {watched}>")
