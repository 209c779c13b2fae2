"""The kernel's view of a multi-rank run whose ranks were forked from it (``notebook_launcher``).

``RankWatches`` is fed by the stream (``nbguard.watcher.distributed.stream``) and looks enough like a
``NanWatch`` for the live dashboard (listeners, ``history``, ``events``): one dashboard for the
run, with a row per rank. Each rank becomes a ``RankWatch`` recorded in the session, so
``%nbguard report`` / ``nbguard.report()`` hold every rank's events (each with its rank) and history.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from ..document.view import plural
from ..findings import Displayable, Event, decode_float, document
from ..watcher.distributed.stream import RankChannel
from ..watcher.reads.history import GradHistory

Listener = Callable[[Any, str, Any], None]


class RankWatch(Displayable):
    """One rank's watch as the kernel received it: events and per-step history."""

    def __init__(self, rank: int, world_size: int, watch_id: str, groups: list[str], policy: str | None = None):
        self.rank, self.world_size, self.watch_id, self.policy = rank, world_size, watch_id, policy
        self.history = GradHistory(groups)
        self.activation_history = None
        self.events: list[Event] = []
        self.last_step: dict[str, Any] = {}

    def add_step(self, payload: dict[str, Any]) -> None:
        norms = payload.get("grad_norm") or {}
        self.history.append(int(payload["step"]), [decode_float(norms.get(g)) for g in self.history.groups],
                            decode_float(payload.get("loss")), decode_float(payload.get("total_grad_norm")),
                            decode_float(payload.get("loss_scale")), bool(payload.get("skipped")))
        self.last_step = payload

    def summary(self) -> str:
        lines = [f"rank {self.rank}: {plural(len(self.history), 'optimizer step')}, "
                 f"{len(self.history.skipped_steps)} skipped, {plural(len(self.events), 'event')}"]
        lines += [f"  step {e.step} [{e.kind}] {e.message}" for e in self.events]
        return "\n".join(lines)

    def to_document(self) -> dict[str, Any]:
        return document("watch", title=f"nbguard NaN/Inf watch (rank {self.rank} of {self.world_size})",
                        watch_id=self.watch_id, events=[e.to_dict() for e in self.events],
                        history=self.history.to_dict())


class RankWatches(Displayable):
    """Every rank of one run; ``on_message`` is the stream's callback (drain thread)."""

    def __init__(self, record: bool = True):
        self.channel: RankChannel | None = None
        self.ranks: dict[int, RankWatch] = {}
        self.record = record
        self._listeners: list[Listener] = []
        self._lock = threading.Lock()

    @property
    def no_rank_attached(self) -> bool:
        """No rank's watch reached the stream: a view of this run has nothing to show."""
        return not self.ranks

    # -- what the dashboard reads ---------------------------------------------------------------
    @property
    def history(self) -> GradHistory:
        """Rank 0's history draws the heatmap; every rank has its own row in the status table."""
        first = self.ranks.get(0) or next(iter(self.ranks.values()), None)
        return first.history if first is not None else GradHistory([])

    activation_history = None

    @property
    def events(self) -> list[Event]:
        return [e for r in sorted(self.ranks) for e in self.ranks[r].events]

    def rank_rows(self) -> list[dict[str, Any]]:
        """Per rank: its last step, loss, grad norm, skipped steps and events (the dashboard's rows)."""
        rows = []
        for r in sorted(self.ranks):
            w = self.ranks[r]
            last = w.last_step
            rows.append({"rank": r, "step": last.get("step"), "loss": last.get("loss"),
                         "total_grad_norm": last.get("total_grad_norm"), "skipped": len(w.history.skipped_steps),
                         "events": len(w.events), "last_event": w.events[-1].kind if w.events else None})
        return rows

    def add_listener(self, callback: Listener) -> None:
        if callback not in self._listeners:
            self._listeners.append(callback)

    def remove_listener(self, callback: Listener) -> None:
        if callback in self._listeners:
            self._listeners.remove(callback)

    # -- the stream -----------------------------------------------------------------------------
    def on_message(self, message: dict[str, Any]) -> None:
        """One message of a rank: "attach", an "event", or "steps" (a rank's coalesced step payloads,
        each handed to the listeners as its own "step")."""
        kind, payload = message["kind"], message["payload"]
        if kind == "steps":
            for step in payload:
                self._receive(message, "step", step)
        else:
            self._receive(message, kind, payload)

    def _receive(self, message: dict[str, Any], kind: str, payload: Any) -> None:
        rank = int(message["rank"])
        with self._lock:
            watch = self.ranks.get(rank)
            if watch is None or (kind == "attach" and watch.watch_id != message["watch_id"]):
                groups = payload.get("groups", []) if kind == "attach" else list(payload.get("grad_norm") or {})
                watch = RankWatch(rank, int(message["world_size"]), message["watch_id"], groups, payload.get("policy"))
                self.ranks[rank] = watch
                if self.record:
                    from ..session import record_watch

                    record_watch(watch)
            if kind == "step":
                watch.add_step(payload)
                payload = dict(payload, rank=rank)
            elif kind == "event":
                payload = Event.from_dict(payload)
                watch.events.append(payload)
            else:
                return
        for callback in list(self._listeners):
            callback(self, kind, payload)

    def summary(self) -> str:
        return "\n".join(self.ranks[r].summary() for r in sorted(self.ranks)) or "nbguard: no rank attached a watch"

    def to_document(self) -> dict[str, Any]:
        """Every rank's watch, kept apart, in one report document."""
        from ..document.merge import merge_documents

        return merge_documents([self.ranks[r].to_document() for r in sorted(self.ranks)],
                               title=f"nbguard NaN/Inf watch across {len(self.ranks)} ranks")

    def open(self) -> RankWatches:
        self.channel = RankChannel(self.on_message).open()
        return self

    def detach(self) -> RankWatches:
        """Stop listening (what the ranks already sent is drawn first)."""
        if self.channel is not None:
            self.channel.close()
        return self


def watch_forked_ranks():
    """What ``%%nanwatch`` around ``notebook_launcher(...)`` starts: the stream and its live view."""
    from .present import LiveWatch

    return LiveWatch(RankWatches().open())
