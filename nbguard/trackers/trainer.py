"""Trainer runs: nbguard's scalars and events ride in the Trainer's own logs, so every integration
in ``report_to`` (W&B, TensorBoard, trackio, MLflow, Comet, …) receives them with no extra code."""
from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from ..document.model import Event
from .scalars import PREFIX, StepScalars
from .sinks import event_text, event_title

REPORT_FILE = "nbguard-report.html"
FIRST_EVENT_TAG = "nbguard.first_event"


def is_reporting(callback: Any) -> bool:
    """A Trainer callback that sends logs to a tracker (transformers' integrations)."""
    return type(callback).__module__.startswith("transformers.integrations")


def _trackio_run() -> Any:
    from trackio import context_vars

    return context_vars.current_run.get()


class ReportToCallback(TrainerCallback):
    """Adds ``nbguard/…`` to each log of the Trainer; placed before the reporting callbacks (the
    Trainer calls its callbacks in order with one logs dict, and an integration sends what is in it
    when its turn comes), and ends the run with the report as an artifact."""

    def __init__(self, watch: Any, max_series: int = 16):
        self.watch = watch
        self.scalars = StepScalars(max_series)
        self._last: dict[str, Any] | None = None  # the newest step not yet in a log
        self._new_events: list[Event] = []
        self._alerted = False
        self._failed = False
        watch.add_listener(self._listen)

    @classmethod
    def install(cls, watch: Any, max_series: int = 16) -> ReportToCallback:
        trainer = watch.trainer
        callbacks = trainer.callback_handler.callbacks
        for old in [cb for cb in callbacks if isinstance(cb, cls)]:  # never two on one Trainer
            old.close()
        callback = cls(watch, max_series)
        first = next((i for i, cb in enumerate(callbacks) if is_reporting(cb)), len(callbacks))
        callbacks.insert(first, callback)
        return callback

    def close(self) -> None:
        self.watch.remove_listener(self._listen)
        if self.watch.trainer is not None and self in self.watch.trainer.callback_handler.callbacks:
            self.watch.trainer.callback_handler.callbacks.remove(self)

    # the watch calls this guarded: an error drops the listener and records a watch-error event
    def _listen(self, watch: Any, kind: str, payload: Any) -> None:
        if kind == "step":
            self.scalars.count_step(payload)
            self._last = payload
        elif kind == "event":
            self.scalars.count_event(payload.kind)
            self._new_events.append(payload)
            if not self._alerted:
                self._alerted = True
                self._alert(payload, watch.trainer.args.report_to if watch.trainer is not None else [])

    @staticmethod
    def _alert(event: Event, report_to: list[str]) -> None:
        """The first event at once: a W&B or trackio alert and an MLflow run tag, where those runs are live."""
        for name in ("wandb", "trackio"):
            if name in report_to and name in sys.modules:
                run = getattr(sys.modules[name], "run", None) if name == "wandb" else _trackio_run()
                if run is not None:
                    run.alert(title=event_title(event), text=event_text(event))
        if "mlflow" in report_to and "mlflow" in sys.modules:
            mlflow = sys.modules["mlflow"]
            if mlflow.active_run() is not None:
                mlflow.set_tag(FIRST_EVENT_TAG, event_text(event))

    def _guard(self, fn: Any, *args: Any) -> None:
        if self._failed:
            return
        try:
            fn(*args)
        except Exception as exc:  # a tracker problem must never end the user's training
            self._failed = True
            warnings.warn(f"nbguard stopped adding its scalars to the Trainer's logs: {type(exc).__name__}: {exc}",
                          RuntimeWarning, stacklevel=2)

    def on_log(self, args, state, control, logs=None, **kwargs):
        self._guard(self._add_to, logs)

    def _add_to(self, logs: dict[str, Any] | None) -> None:
        if logs is None or self._last is None:
            return
        logs.update(self.scalars.of(self._last))
        self._last = None
        if self._new_events:  # a string: TensorBoard writes it as a text summary, W&B into the history
            logs[PREFIX + "event"] = "\n\n".join(event_text(e) for e in self._new_events)
            self._new_events = []

    def on_train_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self._guard(self._attach_report, args)

    def _attach_report(self, args: Any) -> None:
        from ..reporting import build_report

        report = build_report(watch=self.watch)
        path = report.save(Path(args.output_dir) / REPORT_FILE)
        if "wandb" in args.report_to and "wandb" in sys.modules and sys.modules["wandb"].run is not None:
            wandb = sys.modules["wandb"]
            artifact = wandb.Artifact("nbguard-report", type="nbguard-report")
            artifact.add_file(str(path))
            wandb.run.log_artifact(artifact)
        if "mlflow" in args.report_to and "mlflow" in sys.modules and sys.modules["mlflow"].active_run() is not None:
            sys.modules["mlflow"].log_artifact(str(path))
        for callback in self.watch.trainer.callback_handler.callbacks:
            writer = getattr(callback, "tb_writer", None)  # TensorBoardCallback's, still open before its on_train_end
            if writer is not None:
                writer.add_text(PREFIX + "report", report.to_markdown())
