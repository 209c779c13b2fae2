"""Where users already look: nbguard's per-step scalars and events in W&B, TensorBoard, trackio,
MLflow and accelerate's trackers. Nothing here imports a tracker library the user did not hand in."""
from __future__ import annotations

from typing import Any

from .listener import DEFAULT_EVERY, TrackerLog, check_every

REPORT_TO = "report_to"
AUTO = "auto"  # the default: a watched Trainer that reports somewhere carries nbguard there too


def reports_somewhere(trainer: Any) -> bool:
    """Whether the Trainer sends its logs to an integration (``report_to`` other than "none")."""
    from .trainer import is_reporting

    handler = getattr(trainer, "callback_handler", None)
    return any(is_reporting(cb) for cb in getattr(handler, "callbacks", []))


def connect(watch: Any, log_to: Any, every: int = DEFAULT_EVERY, max_series: int = 16, *, rows: bool = False,
            save_report: Any = None) -> Any:
    """Send ``watch``'s scalars and events to ``log_to``: a tracker object (see ``sinks.sink_for``),
    ``"report_to"`` for a watched Trainer (its logs carry them to every integration it reports to), or
    ``"auto"``: "report_to" for a watched Trainer that reports somewhere, else nothing (returns None).

    Nothing is published that the user did not ask for: ``rows=True`` sends the named rows' excerpts
    (the user's data) with the events, else they stay local; ``save_report`` (True: ``nbguard-report.html``
    in the Trainer's ``output_dir``, which ``push_to_hub`` uploads; or a path) writes the report file at the
    end of a Trainer's run, else none is written there."""
    check_every(every)
    if not isinstance(rows, bool):
        raise TypeError(f"log_rows must be True or False, got {type(rows).__name__}")
    if save_report is not None and watch.trainer is None:
        raise ValueError("save_report is for a watched Trainer's run; for a plain loop save the report yourself: "
                         "nbguard.report(watch=watch).save(path)")
    if log_to == AUTO:
        if watch.trainer is None or not (reports_somewhere(watch.trainer) or save_report is not None):
            return None
        log_to = REPORT_TO
    if isinstance(log_to, str):
        if log_to != REPORT_TO:
            raise ValueError(f"log_to={log_to!r}: the names log_to takes are {REPORT_TO!r} (a watched Trainer's "
                             f"integrations) and {AUTO!r}; otherwise pass the tracker object itself, or None")
        if watch.trainer is None:
            raise ValueError("log_to='report_to' needs a watched Trainer; for a plain loop pass the tracker object "
                             "(a SummaryWriter, a wandb/trackio/MLflow run or an accelerate.Accelerator)")
        from .trainer import ReportToCallback

        return ReportToCallback.install(watch, max_series, rows=rows, save_report=save_report)
    if save_report is not None:
        raise ValueError(f"save_report writes a watched Trainer's report at the end of its run, through "
                         f"log_to={REPORT_TO!r} or {AUTO!r}, not through a tracker object")
    from .sinks import sink_for

    return TrackerLog(watch, sink_for(log_to, rows), every, max_series)


__all__ = ["AUTO", "DEFAULT_EVERY", "REPORT_TO", "TrackerLog", "connect", "reports_somewhere"]
