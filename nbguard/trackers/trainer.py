"""Trainer runs: nbguard's scalars and events ride in the Trainer's own logs, so every integration
in ``report_to`` (W&B, TensorBoard, trackio, MLflow, Comet, …) receives them with no extra code."""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from ..document.model import Event
from ..document.outward import exception_line, outward, warn
from ..watcher.localise.rows import without_row_text
from .scalars import PREFIX, StepScalars
from .sinks import event_text, event_title

REPORT_FILE = "nbguard-report.html"
FIRST_EVENT_TAG = "nbguard.first_event"


def check_save_report(value: Any) -> Any:
    """None (no report file), True (``nbguard-report.html`` in ``output_dir``) or a path."""
    if value is None or value is True:
        return value
    if isinstance(value, (str, os.PathLike)) and str(value):
        return value
    raise TypeError(f"save_report must be None, True (nbguard-report.html in the Trainer's output_dir) or a path, "
                    f"got {value!r}")


def is_reporting(callback: Any) -> bool:
    """A Trainer callback that sends logs to a tracker (transformers' integrations)."""
    return type(callback).__module__.startswith("transformers.integrations")


def _trackio_run() -> Any:
    from trackio import context_vars

    return context_vars.current_run.get()


class ReportToCallback(TrainerCallback):
    """Adds ``nbguard/…`` to each log of the Trainer; placed before the reporting callbacks (the
    Trainer calls its callbacks in order with one logs dict, and an integration sends what is in it
    when its turn comes), and ends the run with the report as an artifact (the rows' excerpts left out
    unless ``rows``); the report file is written where ``save_report`` says (True: ``output_dir``), else
    only to a temporary folder the artifact is uploaded from."""

    def __init__(self, watch: Any, max_series: int = 16, *, rows: bool = False, save_report: Any = None):
        self.watch = watch
        self.rows = rows
        self.save_report = check_save_report(save_report)
        self.report_path: Path | None = None  # the report file written at the end of the run
        self.scalars = StepScalars(max_series)
        self._last: dict[str, Any] | None = None  # the newest step not yet in a log
        self._new_events: list[Event] = []
        self._alerted = False
        self._failed = False
        watch.add_listener(self._listen)

    @classmethod
    def install(cls, watch: Any, max_series: int = 16, *, rows: bool = False,
                save_report: Any = None) -> ReportToCallback:
        trainer = watch.trainer
        callbacks = trainer.callback_handler.callbacks
        for old in [cb for cb in callbacks if isinstance(cb, cls)]:  # never two on one Trainer
            old.close()
        callback = cls(watch, max_series, rows=rows, save_report=save_report)
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

    def _alert(self, event: Event, report_to: list[str]) -> None:
        """The first event at once: a W&B or trackio alert and an MLflow run tag, where those runs are live."""
        for name in ("wandb", "trackio"):
            if name in report_to and name in sys.modules:
                run = getattr(sys.modules[name], "run", None) if name == "wandb" else _trackio_run()
                if run is not None:
                    run.alert(title=event_title(event), text=event_text(event, self.rows))
        if "mlflow" in report_to and "mlflow" in sys.modules:
            mlflow = sys.modules["mlflow"]
            if mlflow.active_run() is not None:
                mlflow.set_tag(FIRST_EVENT_TAG, event_text(event, self.rows))

    def _guard(self, fn: Any, *args: Any) -> None:
        if self._failed:
            return
        try:
            fn(*args)
        except Exception as exc:  # a tracker problem must never end the user's training
            self._failed = True
            warn(f"nbguard stopped adding its scalars to the Trainer's logs: {exception_line(exc)}",
                 RuntimeWarning, stacklevel=2)

    def on_log(self, args, state, control, logs=None, **kwargs):
        self._guard(self._add_to, logs)

    def _add_to(self, logs: dict[str, Any] | None) -> None:
        if logs is None or self._last is None:
            return
        logs.update(self.scalars.of(self._last))
        self._last = None
        if self._new_events:  # a string: TensorBoard writes it as a text summary, W&B into the history
            logs[PREFIX + "event"] = "\n\n".join(event_text(e, self.rows) for e in self._new_events)
            self._new_events = []

    def on_train_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self._guard(self._attach_report, args)

    def _attach_report(self, args: Any) -> None:
        from ..reporting import build_report

        watch_doc = self.watch.to_document()
        report = build_report(watch=outward(watch_doc if self.rows else without_row_text(watch_doc)))
        if self.save_report is None:  # nothing written into output_dir (push_to_hub uploads it) unless asked
            path = report.save(Path(tempfile.mkdtemp(prefix="nbguard-")) / REPORT_FILE)
        else:
            where = Path(args.output_dir) / REPORT_FILE if self.save_report is True else Path(self.save_report)
            path = report.save(where)
        self.report_path = path
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
