"""Where users already look: nbguard's per-step scalars and events in W&B, TensorBoard, trackio,
MLflow and accelerate's trackers. Nothing here imports a tracker library the user did not hand in."""
from __future__ import annotations

from typing import Any

from .listener import DEFAULT_EVERY, TrackerLog, check_every

REPORT_TO = "report_to"


def connect(watch: Any, log_to: Any, every: int = DEFAULT_EVERY, max_series: int = 16) -> Any:
    """Send ``watch``'s scalars and events to ``log_to``: a tracker object (see ``sinks.sink_for``),
    or ``"report_to"`` for a watched Trainer (its logs carry them to every integration it reports to)."""
    check_every(every)
    if isinstance(log_to, str):
        if log_to != REPORT_TO:
            raise ValueError(f"log_to={log_to!r}: the only name log_to takes is {REPORT_TO!r} (a watched Trainer's "
                             f"integrations); otherwise pass the tracker object itself")
        if watch.trainer is None:
            raise ValueError("log_to='report_to' needs a watched Trainer; for a plain loop pass the tracker object "
                             "(a SummaryWriter, a wandb/trackio/MLflow run or an accelerate.Accelerator)")
        from .trainer import ReportToCallback

        return ReportToCallback.install(watch, max_series)
    from .sinks import sink_for

    return TrackerLog(watch, sink_for(log_to), every, max_series)


__all__ = ["DEFAULT_EVERY", "REPORT_TO", "TrackerLog", "connect"]
