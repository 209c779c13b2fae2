"""Forked ranks stream their watch to the kernel process (notebook_launcher's workers).

The kernel opens a ``RankChannel`` before the cell forks its workers (``%%nanwatch`` does it): a
fork-context ``SimpleQueue`` (a pipe with a lock, inherited by every forked child) and a daemon
thread in the kernel that drains it, as tqdm draws from a thread. A watch attached in a forked
rank finds the inherited channel and adds one listener that sends what every listener gets — step
payloads and events — tagged with its rank. This is the notebook's view only: training decisions
never wait on it (the ranks agree through torch.distributed, see ``distributed.py``), and a rank
started any other way (torchrun, spawn) has no channel and sends nothing.

Steps are coalesced on the rank: sent together at most every ``STEP_INTERVAL_S`` (an event, a detach
or the rank's exit sends what is pending first, so the order holds and no step is lost). Eight ranks
of a loop at hundreds of steps a second still send the kernel a few messages a second each.
"""
from __future__ import annotations

import math
import multiprocessing
import multiprocessing.util
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from ..core.pipeline import WatchComponent

_CHANNEL: RankChannel | None = None  # inherited by forked children; set only in the kernel process
_STOP = "__nbguard_stream_end__"
STEP_INTERVAL_S = 0.25  # a rank's steps reach the kernel at most this much later than they ended


class RankChannel:
    """The kernel's end of the stream; ``on_message(dict)`` runs on the drain thread."""

    def __init__(self, on_message: Callable[[dict[str, Any]], None]):
        if not callable(on_message):
            raise TypeError("RankChannel(on_message): on_message must be callable with one dict")
        self._queue = multiprocessing.get_context("fork").SimpleQueue()
        self.owner_pid = os.getpid()
        self.on_message = on_message
        self.errors: list[str] = []
        self.received = 0
        self._thread: threading.Thread | None = None

    def open(self) -> RankChannel:
        global _CHANNEL
        if _CHANNEL is not None and _CHANNEL is not self:
            _CHANNEL.close()  # one stream at a time: a second %%nanwatch cell takes over
        _CHANNEL = self
        self._thread = threading.Thread(target=self._drain, name="nbguard-rank-stream", daemon=True)
        self._thread.start()
        return self

    def close(self, timeout: float = 5.0) -> None:
        """Stop after draining what the ranks already sent (the end marker queues behind it)."""
        global _CHANNEL
        if _CHANNEL is self:
            _CHANNEL = None
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join(timeout)
        self._thread = None

    def send(self, message: dict[str, Any]) -> None:
        self._queue.put(message)

    def _drain(self) -> None:
        while True:
            message = self._queue.get()
            if message == _STOP:
                return
            self.received += 1
            try:
                self.on_message(message)
            except Exception as exc:  # a broken view must not stop the stream
                self.errors.append(f"{type(exc).__name__}: {exc}")


def inherited_channel() -> RankChannel | None:
    """The kernel's channel, seen from a forked child (None in the kernel itself or elsewhere)."""
    channel = _CHANNEL
    return channel if channel is not None and channel.owner_pid != os.getpid() else None


class RankStreamer(WatchComponent):
    """The watch listener a forked rank adds: every step payload and event, tagged with the rank.

    Step payloads wait in ``pending`` and go as one "steps" message once ``interval`` has passed since
    the last message; anything else (an event) first sends what is pending. It is also a component of
    the watch, so the watch's detach sends what is pending (the kernel's view gets the last steps then,
    not at the rank's exit)."""

    name = "rank-streamer"

    def __init__(self, channel: RankChannel, rank: int, world_size: int, watch_id: str,
                 interval: float = STEP_INTERVAL_S, clock: Callable[[], float] = time.monotonic):
        self.channel, self.rank, self.world_size, self.watch_id = channel, rank, world_size, watch_id
        self.interval, self.clock = interval, clock
        self.pending: list[Any] = []
        self.messages = 0
        self._last_sent = -math.inf
        # A forked rank ends through multiprocessing's exit, which runs its finalizers (not atexit):
        # the steps still pending then are sent before the process goes.
        multiprocessing.util.Finalize(self, self.flush, exitpriority=10)

    def __call__(self, watch: Any, kind: str, payload: Any) -> None:
        data = payload.to_dict() if hasattr(payload, "to_dict") else payload
        if kind == "step":
            self.pending.append(data)
            if self.clock() - self._last_sent >= self.interval:
                self.flush()
            return
        self.flush()
        self._send(kind, data)

    def detach(self) -> None:
        self.flush()

    def flush(self) -> None:
        """Send the pending steps now (at an event, a detach, the rank's exit)."""
        if self.pending:
            steps, self.pending = self.pending, []
            self._send("steps", steps)

    def _send(self, kind: str, payload: Any) -> None:
        self.channel.send({"rank": self.rank, "world_size": self.world_size, "watch_id": self.watch_id,
                           "kind": kind, "payload": payload})
        self.messages += 1
        self._last_sent = self.clock()


def connect(watch: Any, rank: int, world_size: int) -> RankStreamer | None:
    """Stream ``watch`` to the kernel when this process is a forked rank of a watched cell; the watch keeps
    the streamer it returns (its detach sends what is pending)."""
    channel = inherited_channel()
    if channel is None:
        return None
    streamer = RankStreamer(channel, rank, world_size, watch.watch_id)
    watch.add_listener(streamer)
    watch.add_detector(streamer)  # a component: the watch's detach sends what is pending
    streamer(watch, "attach", {"groups": list(watch.history.groups), "policy": watch.policy})
    return streamer
