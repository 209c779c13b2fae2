"""A resumed Trainer run judged against the checkpoint it resumed from: the learning rate and the loss must
continue where the checkpoint's log left off.

``trainer.train(resume_from_checkpoint=...)`` loads the checkpoint's log into ``trainer.state`` before the
first step. The Trainer rebuilds the scheduler's lambdas from the *new* arguments (a changed max_steps,
warmup or learning_rate moves the LR at the resume step), and resumes whatever optimizer state it finds
(none without optimizer.pt: fresh AdamW moments, and the loss jumps). The first logs after the resume are
compared with the checkpoint's last ones; one event per jump, per ``train()`` call. Host-side only: it
reads ``trainer.state`` and the Trainer's own logs.
"""
from __future__ import annotations

import math
import statistics
import weakref
from typing import Any

import torch

from ...document.model import register_event_kind
from ...findings import Event
from ..core.pipeline import Detector, WatchedRun

KIND = "resume-jump"
register_event_kind(KIND, "a resumed run's first learning rate or loss does not continue the checkpoint's log",
                    ("resumed_at_step", "checkpoint_learning_rate", "expected_learning_rate", "learning_rate",
                     "checkpoint_losses", "loss"))

LR_TOLERANCE = 0.2  # |new - expected| above a fifth of the larger rate: not the schedule the checkpoint followed
LR_LOGS_JUDGED = 3  # the first logs after the resume whose learning rate is judged
LOSS_FACTOR = 1.5  # the first loss over 1.5x the median of the checkpoint's last losses
LAST_LOSSES = 5


class ResumeCheck(Detector):
    name = KIND

    def __init__(self) -> None:
        self._watch: Any = None
        self._state_id: int | None = None  # the TrainerState of the train() call being judged
        self.resumed_at: int | None = None
        self.lrs: list[tuple[int, float]] = []  # the checkpoint's last logged (step, learning_rate)
        self.losses: list[float] = []
        self.judged: set[str] = set()
        self.lr_logs = 0

    def scalars(self, watch: WatchedRun) -> dict[str, torch.Tensor]:
        if self._watch is None:
            self._watch = weakref.ref(watch)
        state = getattr(getattr(watch, "trainer", None), "state", None)
        if state is not None and id(state) != self._state_id:  # a new train() call: a new TrainerState
            self._arm(state)
        return {}

    def _arm(self, state: Any) -> None:
        """Before the first step of a train() call: resumed when the state already holds steps and a log."""
        self._state_id, self.judged, self.lr_logs = id(state), set(), 0
        history = [e for e in getattr(state, "log_history", None) or [] if isinstance(e, dict)]
        step = int(getattr(state, "global_step", 0) or 0)
        self.resumed_at = step if step > 0 and history else None
        self.lrs = [(int(e.get("step", 0)), float(e["learning_rate"])) for e in history
                    if isinstance(e.get("learning_rate"), (int, float))][-2:]
        self.losses = [float(e["loss"]) for e in history if isinstance(e.get("loss"), (int, float))
                       and math.isfinite(e["loss"])][-LAST_LOSSES:]

    def on_log(self, step: int, logs: dict[str, Any]) -> list[Event]:
        if self.resumed_at is None:
            return []
        watch = self._watch() if self._watch is not None else None
        now = int(getattr(getattr(getattr(watch, "trainer", None), "state", None), "global_step", 0) or 0)
        events = []
        lr = logs.get("learning_rate")
        if "lr" not in self.judged and isinstance(lr, (int, float)) and self.lrs:
            # the first resumed step can still run at the checkpoint's last rate (the scheduler steps after
            # it): the first few logs are judged, until one jumps
            self.lr_logs += 1
            if self.lr_logs >= LR_LOGS_JUDGED:
                self.judged.add("lr")
            expected = self._expected_lr(now)
            if abs(lr - expected) > LR_TOLERANCE * max(abs(lr), abs(expected), abs(self.lrs[-1][1])):
                self.judged.add("lr")
                events.append(Event(KIND, step, (
                    f"resumed at step {self.resumed_at}: the learning rate is {lr:.3g}, where the checkpoint's schedule "
                    f"was at {self.lrs[-1][1]:.3g} (about {expected:.3g} expected at step {now}): the scheduler was "
                    "rebuilt from changed arguments (learning_rate, max_steps, warmup, scheduler type)"),
                    evidence={"resumed_at_step": self.resumed_at, "checkpoint_learning_rate": self.lrs[-1][1],
                              "expected_learning_rate": expected, "learning_rate": float(lr), "step": now}))
        loss = logs.get("loss")
        if "loss" not in self.judged and isinstance(loss, (int, float)) and self.losses:
            self.judged.add("loss")
            median = statistics.median(self.losses)
            if math.isfinite(loss) and median > 0 and loss > LOSS_FACTOR * median:
                events.append(Event(KIND, step, (
                    f"resumed at step {self.resumed_at}: the first loss {loss:.4g} is {loss / median:.1f}x the "
                    f"checkpoint's last logged losses (median {median:.4g}): the run did not continue where it "
                    "stopped (an optimizer state that was not restored, a different model path or data order)"),
                    evidence={"resumed_at_step": self.resumed_at, "checkpoint_losses": list(self.losses),
                              "loss": float(loss), "step": now}))
        return events

    def _expected_lr(self, step: int) -> float:
        """The checkpoint's schedule continued to ``step``: the line through its last two logged LRs."""
        (s1, lr1), (s2, lr2) = (self.lrs[0], self.lrs[-1]) if len(self.lrs) == 2 else (self.lrs[-1], self.lrs[-1])
        if s2 == s1:
            return lr2
        return max(lr2 + (lr2 - lr1) / (s2 - s1) * (step - s2), 0.0)
