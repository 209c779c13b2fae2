"""One small adapter per tracker object ``log_to`` accepts: scalars at a step, an event as text.

Each is picked by the object's type's module, so no tracker library is imported unless the user
handed nbguard one of its objects.
"""
from __future__ import annotations

from typing import Any

from ..document.model import Event
from ..document.outward import outward_text
from ..watcher.localise.rows import without_row_text


def event_text(event: Event, rows: bool = False) -> str:
    """One Markdown line per event: what, when, and where it was born when the replay found it; passed
    through the output boundary (a tracker's run is uploaded and shared). The named rows' excerpts (the
    user's data) are left out unless ``rows``."""
    message = event.message if rows else without_row_text({"message": event.message,
                                                            "evidence": event.evidence})["message"]
    where = f" (origin `{event.origins[0].module}`)" if event.origins else ""
    return outward_text(f"**{event.kind}** at step {event.step}: {message}{where}")


def event_title(event: Event) -> str:
    return outward_text(f"nbguard: {event.kind} at step {event.step}")


class TensorBoardSink:
    """A ``torch.utils.tensorboard`` (or tensorboardX) ``SummaryWriter``: scalars, events as a text summary."""

    def __init__(self, writer: Any, rows: bool = False):
        self.writer = writer
        self.rows = rows

    def scalars(self, values: dict[str, float], step: int) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)

    def event(self, event: Event) -> None:
        self.writer.add_text("nbguard/events", event_text(event, self.rows), event.step)
        self.writer.flush()  # events at once: a crash right after must not lose them


class WandbSink:
    """A ``wandb`` run: scalars against their own ``nbguard/step`` axis (W&B's own step belongs to the
    user's logging), the event text in the history and a W&B alert on the first event."""

    STEP = "nbguard/step"

    def __init__(self, run: Any, rows: bool = False):
        self.run = run
        self.rows = rows
        self.alerted = False
        run.define_metric(self.STEP)
        run.define_metric("nbguard/*", step_metric=self.STEP)

    def scalars(self, values: dict[str, float], step: int) -> None:
        self.run.log({**values, self.STEP: step})

    def event(self, event: Event) -> None:
        self.run.log({"nbguard/event": event_text(event, self.rows), self.STEP: event.step})
        if not self.alerted:
            self.alerted = True
            self.run.alert(title=event_title(event), text=event_text(event, self.rows))


class TrackioSink:
    """A ``trackio`` run (``trackio.init(...)``): scalars, each event's text in the run's log, and a
    trackio alert on the first event."""

    def __init__(self, run: Any, rows: bool = False):
        self.run = run
        self.rows = rows
        self.alerted = False

    def scalars(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def event(self, event: Event) -> None:
        self.run.log({"nbguard/event": event_text(event, self.rows)}, step=event.step)
        if not self.alerted:
            self.alerted = True
            self.run.alert(title=event_title(event), text=event_text(event, self.rows), step=event.step)


class MlflowSink:
    """An MLflow ``ActiveRun`` (``mlflow.start_run()``): metrics, and the first event as a run tag."""

    TAG = "nbguard.first_event"

    def __init__(self, run: Any, rows: bool = False):
        from mlflow import MlflowClient

        self.rows = rows
        self.run_id = run.info.run_id
        self.client = MlflowClient()
        self.tagged = False

    def scalars(self, values: dict[str, float], step: int) -> None:
        import mlflow

        mlflow.log_metrics(values, step=step, run_id=self.run_id)

    def event(self, event: Event) -> None:
        if not self.tagged:
            self.tagged = True
            self.client.set_tag(self.run_id, self.TAG, event_text(event, self.rows))


class AccelerateSink:
    """An ``accelerate.Accelerator``: scalars through ``accelerator.log`` (every tracker it was set up
    with); the event text to those of its trackers that take text."""

    def __init__(self, accelerator: Any, rows: bool = False):
        self.accelerator = accelerator
        self.rows = rows
        self._text_sinks: dict[int, Any] = {}  # id(inner tracker) -> its sink, made once (one alert per run)

    def scalars(self, values: dict[str, float], step: int) -> None:
        self.accelerator.log(values, step=step)

    def event(self, event: Event) -> None:
        for tracker in self.accelerator.trackers:
            inner = getattr(tracker, "tracker", None)  # the tracker library's own writer or run
            if _kind(inner) in ("tensorboard", "wandb", "trackio", "mlflow"):
                if id(inner) not in self._text_sinks:
                    self._text_sinks[id(inner)] = sink_for(inner, self.rows)
                self._text_sinks[id(inner)].event(event)


_SINKS = {"tensorboard": TensorBoardSink, "wandb": WandbSink, "trackio": TrackioSink, "mlflow": MlflowSink,
          "accelerate": AccelerateSink}


def _kind(obj: Any) -> str | None:
    cls = type(obj)
    module = cls.__module__.split(".")[0]
    if module in ("torch", "tensorboardX") and cls.__name__ == "SummaryWriter":
        return "tensorboard"
    if module == "wandb" and hasattr(obj, "log") and hasattr(obj, "alert"):
        return "wandb"
    if module == "trackio" and hasattr(obj, "log"):
        return "trackio"
    if module == "mlflow" and cls.__name__ == "ActiveRun":
        return "mlflow"
    if module == "accelerate" and cls.__name__ == "Accelerator":
        return "accelerate"
    return None


def sink_for(obj: Any, rows: bool = False) -> Any:
    """The adapter for ``obj`` (``rows``: events carry their rows' excerpts); a clear error for anything else."""
    kind = _kind(obj)
    if kind is None:
        raise TypeError(f"log_to must be a TensorBoard SummaryWriter, a wandb run (wandb.init()), a trackio run "
                        f"(trackio.init()), an MLflow run (mlflow.start_run()) or an accelerate.Accelerator; "
                        f"got {type(obj).__module__}.{type(obj).__name__}. For a Trainer, pass log_to='report_to' "
                        f"to log through the integrations in its report_to.")
    return _SINKS[kind](obj, rows)
