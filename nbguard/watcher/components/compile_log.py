"""What ``torch.compile`` did at each optimizer step, read off dynamo's own counters: the cause of slow steps.

Dynamo counts what it compiles (``torch._dynamo.utils.counters``: frames compiled and the ones it gave up
on, graph breaks by reason, the recompile limit hit) and keeps the reason of every guard that failed, by
code object (``guard_failures``). The step clock calls :meth:`CompileLog.tick` at each step's end: one
dictionary read of the frames compiled so far, compared with the last step's. Only a step that compiled
(a step already slowed by seconds of compilation) reads the rest and keeps a :class:`Compiled` record.
Nothing here imports torch, touches a tensor or syncs a device: where ``torch._dynamo`` is not loaded
(nothing was compiled) a tick is one ``sys.modules`` lookup.

:meth:`CompileLog.cause` names, for the steps of a ``slow-steps`` episode, what dynamo did in them:
``recompiles`` (guards failed on new shapes, a Python number, an object's identity), ``graph-breaks`` (new
breaks split the graph), ``eager-fallback`` (the recompile limit was hit, or dynamo gave up on a frame: it
runs uncompiled from then on) or ``compiles`` (new code compiled, e.g. an evaluation path).
"""
from __future__ import annotations

import sys
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ...introspect.dynamo_guards import REMEDIES, guard_kind, reason_line, where

RECORDS = 64  # compiling steps remembered
REASONS = 5  # reasons kept per kind on a record and on an event
_LIMIT = ("recompile limit", "recompile_limit", "cache size limit", "cache_size_limit")


@dataclass
class Compiled:
    """One step in which dynamo compiled: how many frames, why it recompiled, what broke the graph."""

    step: int
    frames: int  # frames dynamo compiled (or tried to) in this step
    gave_up: int = 0  # of those, frames it did not compile: they run eagerly
    limit_hit: bool = False  # the recompile limit was hit in this step
    recompiles: int = 0  # frames compiled again because a known function's guards failed
    reasons: list[str] = field(default_factory=list)  # the first guard failures' reasons, de-duplicated
    functions: list[str] = field(default_factory=list)  # the functions that recompiled
    graph_breaks: list[str] = field(default_factory=list)  # new graph breaks' first lines


def break_line(reason: Any) -> str:
    """A graph break's kind and, where dynamo gives one, its explanation (which names the call that broke it)."""
    lines = [line.strip() for line in str(reason).strip().splitlines() if line.strip()]
    if not lines:
        return ""
    explanation = next((line.removeprefix("Explanation:").strip() for line in lines[1:]
                        if line.startswith("Explanation:")), None)
    return f"{lines[0]}: {explanation}" if explanation else lines[0]


class CompileLog:
    """Dynamo's counters as of the last step, and the recent steps that compiled."""

    def __init__(self) -> None:
        self.records: deque[Compiled] = deque(maxlen=RECORDS)
        self.total = 0  # frames dynamo had counted at the last tick
        self.ok = 0
        self.guards: dict[Any, int] = {}  # code object -> guard failures counted for it
        self.breaks: dict[str, int] = {}  # graph-break reason -> count
        self.limits = 0  # recompile-limit hits counted
        try:  # what compiled before the watch is not the run's
            self._snapshot(sys.modules.get("torch._dynamo.utils"))
        except Exception:
            pass

    def tick(self, step: int) -> None:
        """At a step's end: did dynamo compile in this step? (The steady-state cost is this one comparison.)"""
        utils = sys.modules.get("torch._dynamo.utils")
        if utils is None:
            return
        frames = utils.counters.get("frames")
        total = frames.get("total", 0) if frames is not None else 0
        if total == self.total:
            return
        try:
            if total < self.total:  # torch._dynamo.reset() cleared the counters: start over from here
                self._snapshot(utils)
            else:
                self._record(step, utils, total)
        except Exception:  # dynamo's internals moved: the cause goes unnamed, the run and the watch go on
            self.total = total

    def _snapshot(self, utils: Any) -> None:
        if utils is None:
            return
        counters = utils.counters
        frames = counters.get("frames") or {}
        self.total, self.ok = frames.get("total", 0), frames.get("ok", 0)
        self.guards = {code: len(reasons) for code, reasons in list(utils.guard_failures.items())}
        self.breaks = dict(counters.get("graph_break") or {})
        self.limits = limit_hits(counters)

    def _record(self, step: int, utils: Any, total: int) -> None:
        counters = utils.counters
        ok = (counters.get("frames") or {}).get("ok", 0)
        record = Compiled(step, total - self.total, gave_up=max(0, (total - self.total) - (ok - self.ok)))
        for code, reasons in list(utils.guard_failures.items()):
            new = reasons[self.guards.get(code, 0):]
            self.guards[code] = len(reasons)
            if not new:
                continue
            record.recompiles = record.frames  # a function's guards failed: this step's compiles were recompiles
            name = where(code)
            if name not in record.functions and len(record.functions) < REASONS:
                record.functions.append(name)
            line = reason_line(new[0])  # a miss lists every cache entry's failure, the newest entry's first
            if line and line not in record.reasons and len(record.reasons) < REASONS:
                record.reasons.append(line)
        breaks = dict(counters.get("graph_break") or {})
        record.graph_breaks = [break_line(reason) for reason, count in breaks.items()
                               if count > self.breaks.get(reason, 0)][:REASONS]
        self.breaks = breaks
        limits = limit_hits(counters)
        record.limit_hit = limits > self.limits
        self.total, self.ok, self.limits = total, ok, limits
        self.records.append(record)

    def cause(self, first_step: int, last_step: int) -> dict[str, Any] | None:
        """What dynamo did in steps ``first_step..last_step``, or None where it compiled nothing in them."""
        steps = [r for r in self.records if first_step <= r.step <= last_step]
        if not steps:
            return None
        reasons = unique(line for r in steps for line in r.reasons)
        breaks = unique(line for r in steps for line in r.graph_breaks)
        gave_up = sum(r.gave_up for r in steps)
        limit_hit = any(r.limit_hit for r in steps)
        if limit_hit or gave_up:
            kind = "eager-fallback"
        elif any(r.recompiles for r in steps):
            kind = "recompiles"
        elif breaks:
            kind = "graph-breaks"
        else:
            kind = "compiles"
        return {"cause": kind, "compiling_steps": [r.step for r in steps], "frames": sum(r.frames for r in steps),
                "recompiles": sum(r.recompiles for r in steps), "gave_up": gave_up, "limit_hit": limit_hit,
                "reasons": reasons, "graph_breaks": breaks,
                "functions": unique(name for r in steps for name in r.functions), "fix": remedy(kind, reasons)}


def limit_hits(counters: Any) -> int:
    """Recompile-limit hits dynamo counted (as unsupported frames: "Dynamo recompile limit exceeded")."""
    unimplemented = counters.get("unimplemented") or {}
    return sum(count for reason, count in list(unimplemented.items())
               if any(word in str(reason).lower() for word in _LIMIT))


def unique(lines: Any) -> list[str]:
    out: list[str] = []
    for line in lines:
        if line not in out and len(out) < REASONS:
            out.append(line)
    return out


def remedy(kind: str, reasons: list[str]) -> str:
    if kind == "graph-breaks":
        return ("new graph breaks split the compiled graph (a .item(), a print, a data-dependent branch, an "
                "unsupported call): move them out of the compiled region, or run TORCH_LOGS=graph_breaks to see each")
    if kind == "compiles":
        return ("new code was compiled in these steps (an evaluation or another path seen for the first time); if "
                "it recurs, TORCH_LOGS=recompiles names why")
    why = REMEDIES[guard_kind(reasons)]
    if kind == "eager-fallback":
        return ("dynamo hit its recompile limit (torch._dynamo.config.recompile_limit) or gave up on a frame, which "
                "now runs uncompiled (eager) on every call; " + why)
    return why


def compile_words(cause: dict[str, Any], slow_steps: int) -> str:
    """The slow-steps message's sentence on what torch.compile did in the slow steps (the message ends without a period)."""
    steps = len(cause["compiling_steps"])
    did = {"recompiles": f"recompiled {cause['frames']} time(s)",
           "eager-fallback": f"compiled {cause['frames']} frame(s) and then fell back to running uncompiled (eager)",
           "graph-breaks": f"compiled {cause['frames']} frame(s) split by new graph breaks",
           "compiles": f"compiled {cause['frames']} new frame(s)"}[cause["cause"]]
    text = f". The cause here: torch.compile {did} in {steps} of these {slow_steps} steps"
    if cause["functions"]:
        text += f" ({', '.join(cause['functions'][:2])})"
    if cause["reasons"]:
        text += f"; the guard that failed: {cause['reasons'][0]}"
    if cause["graph_breaks"]:
        text += f"; the graph break: {cause['graph_breaks'][0]}"
    return text + f". Fix: {cause['fix']}"
