"""``TrackerLog``: a watch listener that sends every N-th step's scalars, and every event at once,
to one tracker sink."""
from __future__ import annotations

from typing import Any

from .scalars import StepScalars

DEFAULT_EVERY = 10  # steps between two logged steps; a step with an event is always logged


def check_every(every: Any) -> int:
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"log_every must be a positive int (log every N optimizer steps), got {every!r}")
    return every


class TrackerLog:
    """Listens to one watch (``watch.add_listener``); the watch drops it, with a watch-error event,
    if the tracker ever raises, so a broken tracker never breaks training."""

    def __init__(self, watch: Any, sink: Any, every: int = DEFAULT_EVERY, max_series: int = 16):
        self.watch = watch
        self.sink = sink
        self.every = check_every(every)
        self.scalars = StepScalars(max_series)
        self._event_in_step = False
        watch.add_listener(self)

    def __call__(self, watch: Any, kind: str, payload: Any) -> None:
        if kind == "event":
            self.scalars.count_event(payload.kind)
            self.sink.event(payload)
            self._event_in_step = True
        elif kind == "step":
            self.scalars.count_step(payload)
            if self._event_in_step or payload["step"] % self.every == 0:
                self.sink.scalars(self.scalars.of(payload), payload["step"])
            self._event_in_step = False

    def close(self) -> None:
        self.watch.remove_listener(self)
