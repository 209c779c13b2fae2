"""Stalls and slowdowns: a heartbeat for steps that never come, and an event for steps that got slow.

A watch component (:mod:`nbguard.watcher.core.registry`), section ``stall`` of ``WatchConfig``
(``after_s``: the floor of the bound; None turns the heartbeat off, slow steps are still judged).

**The step clock** (:class:`StepClock`) writes a timestamp at each optimizer step's end and
at each forward's start; nothing else runs on the step path but one frame check (is the loop that
stepped last time still the one stepping?). The gaps between step ends are the run's step times.

**The heartbeat** (:class:`Heartbeat`) is a daemon thread that wakes a few times per bound and asks
whether anything happened within the bound: ``max(stall_after_s, 10 x the median step time, 3 x the
longest recent one)`` once ``LEARN_STEPS`` step times are known, ``FIRST_STEPS_FACTOR x
stall_after_s`` before (a first step compiles, allocates, fills caches). Past the bound it records one
``stall`` event carrying every thread's Python stack (``sys._current_frames``, the training thread's
first) and the step it waits after; the training thread's next step end says on the same event when
the run resumed. Under torch.distributed the event names the rank and, where the training thread is
inside ``torch.distributed``, DistributedDataParallel's forward (its buffer broadcast) or, with several ranks,
autograd's backward (where DDP's gradient all-reduce waits), the collective it waits in; inside TRL's weight
sync to vLLM (``introspect/weight_sync.py``: a wait with no timeout, trl#6796), the sync's frames. A checkpoint save
(``SAVE_FRAMES``: the Trainer's ``_save_checkpoint``, ``save_pretrained``, ``torch.save``, safetensors,
accelerate's ``save_state``...) on the training thread's stack is not silence: each wake-up looks for one, the
bound counts from the last look that saw it, and the gap around it is not learned; only a save that lasts
``SAVE_FACTOR`` bounds is a stall (``evidence.saving`` names it). It judges only while a loop runs: armed by a
training forward, a step end or ``Trainer.train()``, and disarmed when the frame that ran the loop (the
innermost frame of the user's code on the training thread's stack at the last step) is gone: a notebook
kernel idle between cells, or a loop function that returned, is not a stall.

**Slow steps** (``slow-steps``): ``SLOW_STREAK`` step times in a row over ``SLOW_FACTOR x`` the median
of the last ``WINDOW`` ordinary ones (refreshed every ``MEDIAN_EVERY``), after ``SLOW_WARMUP`` steps (compilation, warm-up) and once
``SLOW_BASELINE`` ordinary step times are known. One event per episode; the step that is ordinary again
closes it (``recovered_at_step``). Step times across a stall, or across a pause between two loops, are
not learned. A step must be slow for its own work: once a step is over the threshold, the clock reads how
long the training thread has waited for a CPU (:mod:`.cpu_wait`) at each step end until one is ordinary,
and a step that is no longer over the threshold less that wait, a wait of at least half its excess over
the median, was slowed by other processes taking the cores (a shared machine, CI lanes beside the run):
it is not slow, not learned, and it ends the streak (``load_slowed`` counts them). The first step over the threshold has no reading from its start, so a streak
holds at least ``SLOW_STREAK - 1`` steps slow for their own work; where the wait cannot be read (not Linux)
steps are judged on their time alone.

Nothing here touches the device; the heartbeat never raises into the run (a failure inside it is one
``watch-error`` event, and the heartbeat stops; the watch goes on).
"""
from __future__ import annotations

import math
import os
import statistics
import sys
import sysconfig
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass
from types import CodeType, FrameType
from typing import Any

from ...document.model import register_event_kind
from ...findings import Event
from ...introspect.weight_sync import describe, weight_sync_frames
from ..core.context import WatchContext
from ..core.pipeline import StepView, WatchComponent
from ..core.registry import ComponentSetup, register_component
from .compile_log import CompileLog, compile_words
from .cpu_wait import cpu_wait_ns

STALL = "stall"
SLOW = "slow-steps"
register_event_kind(STALL, "no optimizer step completed within the bound learned from the run's own step times "
                           "(every thread's Python stack at that moment)",
                    ("after_step", "waited_s", "bound_s", "waiting_in", "user_frame", "collective", "saving",
                     "weight_sync", "stacks", "resumed_at_step", "stalled_s"))
register_event_kind(SLOW, "optimizer steps took several times the run's median step time, several steps in a row",
                    ("first_step", "steps", "median_s", "ratio", "recent_s", "recovered_at_step", "cause"))

DEFAULT_STALL_AFTER_S = 120.0  # the floor of the bound: a stall is never called sooner
STALL_MEDIAN_FACTOR = 10.0  # the learned bound: this many median step times...
STALL_MAX_FACTOR = 3.0  # ...or this many of the longest recent one (periodic evaluations), whichever is longer
LEARN_STEPS = 3  # step times known before the bound is learned
FIRST_STEPS_FACTOR = 5.0  # before that: this many floors
WINDOW = 32  # recent step times kept
SLOW_FACTOR = 3.0
SLOW_STREAK = 4
SLOW_WARMUP = 5
SLOW_BASELINE = 8
MEDIAN_EVERY = 8
SLOW_MIN_EXTRA_S = 0.02  # a slow step is also this much slower than the median (a 1 ms step at 3 ms is noise)
SAVE_FACTOR = 10.0  # a checkpoint save is a stall only once it has lasted this many bounds
STACK_FRAMES = 24  # innermost frames kept per thread
STACK_THREADS = 16
THREAD_NAME = "nbguard-heartbeat"

_NBGUARD = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LIBRARY = tuple(sorted({os.path.join(os.path.abspath(p), "") for key in ("stdlib", "platstdlib", "purelib", "platlib")
                         if (p := sysconfig.get_paths().get(key))} | {os.path.join(_NBGUARD, "")}))


def check_stall_after(value: Any) -> float | None:
    """``after_s`` (``stall_after_s``): a positive number of seconds, or None (no heartbeat)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"the stall section's after_s (stall_after_s) must be a number of seconds (the floor of the "
                        f"stall bound) or None to turn the heartbeat off, got {type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"the stall section's after_s (stall_after_s) must be a positive, finite number of seconds, "
                         f"got {value!r} (None turns the heartbeat off)")
    return float(value)


def is_library(filename: str) -> bool:
    """A frame of the standard library, an installed package or nbguard itself, not the user's code."""
    if filename.startswith("<"):
        return filename.startswith("<frozen")
    return os.path.abspath(filename).startswith(_LIBRARY)


def innermost_user_frame(frame: FrameType | None) -> tuple[FrameType | None, int]:
    """The innermost frame of the user's code at or above ``frame``, and how many frames up it is."""
    depth = 0
    while frame is not None:
        if not is_library(frame.f_code.co_filename):
            return frame, depth
        frame, depth = frame.f_back, depth + 1
    return None, -1


def where(frame: FrameType) -> str:
    return f"{frame.f_code.co_name} ({frame.f_code.co_filename}:{frame.f_lineno})"


# Checkpoint saves: (a path fragment of the library, the function names that save). The outermost one on the
# training thread's stack names the save (the Trainer's _save_checkpoint rather than the torch.save inside it).
SAVE_FRAMES = (
    ("/transformers/", ("_save_checkpoint", "save_model", "_save", "save_pretrained", "_save_optimizer_and_scheduler",
                        "_save_rng_state", "_save_tpu", "_save_fsdp")),
    ("/peft/", ("save_pretrained",)),
    ("/accelerate/", ("save_state", "save_model", "save", "save_accelerator_state")),
    ("/torch/serialization.py", ("save",)),
    ("/torch/distributed/checkpoint/", ("save", "async_save", "save_state_dict")),
    ("/safetensors/", ("save_file", "save_model", "save")),
    ("/huggingface_hub/", ("save_torch_state_dict", "save_torch_model")),
)


_SAVES: dict[CodeType, bool] = {}  # code object -> is it a save? (the heartbeat walks the stack at every wake-up)


def _is_save(code: CodeType) -> bool:
    known = _SAVES.get(code)
    if known is None:
        path = code.co_filename.replace("\\", "/")
        known = any(code.co_name in names and fragment in path for fragment, names in SAVE_FRAMES)
        if len(_SAVES) < 4096:
            _SAVES[code] = known
    return known


def saving(frame: FrameType | None) -> FrameType | None:
    """The outermost checkpoint-saving frame on this stack (``SAVE_FRAMES``), or None."""
    found = None
    while frame is not None:
        if _is_save(frame.f_code):
            found = frame
        frame = frame.f_back
    return found


@dataclass(frozen=True)
class StallSettings:
    """``WatchConfig(stall=...)``."""

    after_s: float | None = DEFAULT_STALL_AFTER_S  # the floor of the stall bound, seconds; None: no heartbeat

    def __post_init__(self) -> None:
        check_stall_after(self.after_s)


class StepClock(WatchComponent):
    """The step times (a timestamp per step end), the ``slow-steps`` check, and what the heartbeat reads."""

    name = "step-clock"

    def __init__(self, stall_after_s: float | None = DEFAULT_STALL_AFTER_S):
        self.stall_after_s = check_stall_after(stall_after_s)
        self.gaps: deque[float] = deque(maxlen=WINDOW)  # recent step times (the heartbeat's bound)
        self.last_end: float | None = None  # monotonic time of the last step end (None: the next gap is not a step time)
        self.last_beat = time.monotonic()  # the last sign of life: a step end or a forward
        self.after_step: int | None = None  # the last completed optimizer step
        self.armed = False  # a loop runs: the heartbeat judges
        self.thread: int | None = None  # the training thread's ident
        self.loop: tuple[int, Any] | None = None  # (id, code) of the innermost user frame that stepped
        self._loop_depth = -1  # how far up from update() that frame was
        self.stall: tuple[Event, float] | None = None  # the open stall and when its silence began
        self.save_seen = -math.inf  # monotonic time the heartbeat last saw the training thread inside a save
        self.saving: dict[str, Any] | None = None  # the save it sees now: {"in", "since", "looks"}
        self.saves: deque[tuple[str, float]] = deque(maxlen=WINDOW)  # recent saves the heartbeat saw, and their seconds
        self.timed = 0  # step times seen
        self.baseline: deque[float] = deque(maxlen=WINDOW)  # ordinary step times (slow-steps)
        self.streak: list[tuple[int, float]] = []
        self.episode: Event | None = None  # the open slow-steps episode
        self.waited_ns: int | None = None  # the CPU wait read at the last step end (only after a suspect step)
        self.load_slowed = 0  # steps over the threshold that were not, less the time they waited for a CPU
        self._median = 0.0  # the baseline's median, recomputed every MEDIAN_EVERY ordinary steps (a sort of 32)
        self._fresh = 0  # ordinary step times added since
        self.heartbeat: Heartbeat | None = None
        self.compiles = CompileLog()  # what torch.compile did per step: names a slow-steps episode's cause

    # ---- the watch's lifecycle points -----------------------------------------------------------------
    def attach(self, context: WatchContext) -> None:
        self.start(context)

    def detach(self) -> None:
        self.stop()

    def on_forward_start(self) -> None:
        self.forward()

    def on_train_begin(self) -> None:
        self.arm()

    def on_train_end(self) -> None:
        self.disarm()  # no step is awaited until the next train()

    def rewound(self, step: int) -> None:
        """Policy rewind restored a snapshot in this step: the watch's own work, not the step's time."""
        self.last_end = None
        self.streak = []
        self.waited_ns = None

    # ---- the training thread -------------------------------------------------------------------------
    def forward(self) -> None:
        """A forward starts (the watch's root pre-hook): a sign of life; the first one arms the heartbeat."""
        self.last_beat = time.monotonic()
        if not self.armed:
            try:
                self._find_loop(sys._getframe(1), update=False)
                self.armed = True
            except Exception:  # never into the user's forward: the next step end arms it
                pass

    def update(self, view: StepView) -> list[Event]:
        now = time.monotonic()
        last = self.last_end
        self.last_end = self.last_beat = now
        self.after_step = view.step
        self.compiles.tick(view.step)
        depth = self._loop_depth
        try:
            frame: FrameType | None = sys._getframe(depth) if depth >= 0 else None
        except ValueError:
            frame = None
        loop = self.loop
        if frame is None or loop is None or id(frame) != loop[0] or frame.f_code is not loop[1]:
            if self._find_loop(sys._getframe(), update=True):
                last = None  # a new loop: the time since the last one's last step is not a step time
        del frame
        self.armed = True
        if self.stall is not None:
            self._resumed(view.step, now)
            last = None  # a stall is not a step time to learn
        if last is not None and self.save_seen >= last:
            last = None  # a checkpoint save ran in this gap: not a step time (nor a slow step)
        if last is None:
            self.waited_ns = None  # a reading from before this gap does not bracket the next step
            return []
        gap = now - last
        self.gaps.append(gap)
        return self._judge_slow(view.step, gap)

    def _find_loop(self, frame: FrameType, update: bool) -> bool:
        """Take the innermost user frame above ``frame`` as the loop's; True if it is another loop's."""
        user, depth = innermost_user_frame(frame)
        self.thread = threading.get_ident()
        found = (id(user), user.f_code) if user is not None else None
        changed = self.loop is not None and found != self.loop
        self.loop = found
        self._loop_depth = depth if update else -1  # the fast check runs from update() only
        return changed

    def _resumed(self, step: int, now: float) -> None:
        event, silent_since = self.stall or (None, now)
        self.stall = None
        if event is None:
            return
        stalled = now - silent_since
        event.evidence.update(resumed_at_step=step, stalled_s=stalled)
        event.message += f"; the run resumed at step {step} after {stalled:.1f} s"

    def arm(self) -> None:
        """``Trainer.train()`` starts: its loop runs from here."""
        self.last_beat = time.monotonic()
        self.last_end = None
        self.armed = True
        self._find_loop(sys._getframe(1), update=False)

    def disarm(self) -> None:
        """The loop ended (``Trainer.train()`` returned, or the frame that ran it is gone)."""
        self.armed = False
        self.last_end = None
        self.saving = None

    # ---- slow steps ----------------------------------------------------------------------------------
    def _judge_slow(self, step: int, gap: float) -> list[Event]:
        self.timed += 1
        if self.timed <= SLOW_WARMUP:
            return []
        if len(self.baseline) < SLOW_BASELINE:
            self.baseline.append(gap)
            self._fresh = MEDIAN_EVERY
            return []
        if self._fresh >= MEDIAN_EVERY:
            self._median, self._fresh = statistics.median(self.baseline), 0
        median = self._median
        before, self.waited_ns = self.waited_ns, None
        if gap <= SLOW_FACTOR * median or gap - median <= SLOW_MIN_EXTRA_S:  # (_over inlined: every step)
            if self.episode is not None:
                self.episode.evidence["recovered_at_step"] = step
                self.episode = None
            self.streak = []
            self.baseline.append(gap)
            self._fresh += 1
            return []
        waited = self.waited_ns = cpu_wait_ns()  # a suspect step: the next one is judged less its wait for a CPU
        if before is not None and waited is not None and _load_slowed(gap, (waited - before) / 1e9, median):
            self.load_slowed += 1  # slow for waiting on a CPU other processes took: not for the run's own work
            self.streak = []
            return []
        self.streak.append((step, gap))
        if self.episode is not None:
            evidence = self.episode.evidence
            evidence["steps"] += 1
            evidence["last_step"] = step
            if len(evidence["recent_s"]) < WINDOW:
                evidence["recent_s"].append(gap)
            return []
        if len(self.streak) < SLOW_STREAK:
            return []
        times = [g for _, g in self.streak]
        ratio = statistics.median(times) / median
        first = self.streak[0][0]
        self.episode = Event(
            SLOW, first,
            f"optimizer steps took {ratio:.1f}x the run's median step time ({statistics.median(times):.3g} s against "
            f"{median:.3g} s) for {len(times)} steps in a row from step {first}: something in the step got slower. "
            f"Usual causes: a silent CPU fallback (a tensor or an op that left the accelerator), memory thrash "
            f"(swapping, or the allocator retrying near the memory limit), a dataloader gone synchronous (workers "
            f"died or num_workers=0), or another process on the same device",
            evidence={"first_step": first, "last_step": step, "steps": len(times), "median_s": median,
                      "ratio": ratio, "factor": SLOW_FACTOR, "recent_s": times})
        compiled = self.compiles.cause(first, step)
        if compiled is not None:
            self.episode.evidence["cause"] = compiled
            self.episode.message += compile_words(compiled, len(times))
        return [self.episode]

    # ---- what the heartbeat reads --------------------------------------------------------------------
    def bound(self) -> tuple[float, str]:
        """The silence that makes a stall, in seconds, and how it was set."""
        floor = self.stall_after_s or DEFAULT_STALL_AFTER_S
        gaps = list(self.gaps)
        if len(gaps) < LEARN_STEPS:
            return FIRST_STEPS_FACTOR * floor, f"{FIRST_STEPS_FACTOR:g} x stall_after_s before {LEARN_STEPS} step times"
        learned = max(STALL_MEDIAN_FACTOR * statistics.median(gaps), STALL_MAX_FACTOR * max(gaps))
        if learned <= floor:
            return floor, "stall_after_s (the run's steps are much shorter)"
        return learned, (f"{STALL_MEDIAN_FACTOR:g} x the median step time or {STALL_MAX_FACTOR:g} x the longest of "
                         f"the last {len(gaps)}")

    # ---- the watch's attach and detach ---------------------------------------------------------------
    def start(self, context: WatchContext) -> None:
        if self.stall_after_s is None or (self.heartbeat is not None and self.heartbeat.alive):
            return
        self.heartbeat = Heartbeat(self, context).start()

    def stop(self) -> None:
        heartbeat, self.heartbeat = self.heartbeat, None
        if heartbeat is not None:
            heartbeat.stop()
        self.disarm()


def _over(seconds: float, median: float) -> bool:
    """Over the slow-steps threshold: ``SLOW_FACTOR`` x the median, and ``SLOW_MIN_EXTRA_S`` more than it."""
    return seconds > SLOW_FACTOR * median and seconds - median > SLOW_MIN_EXTRA_S


def _load_slowed(gap: float, waited: float, median: float) -> bool:
    """A step over the threshold only for waiting on a CPU: under it less the wait, and the wait is at least half
    its excess over the median (the median was learned with the machine's usual wait in it: a step barely over it
    less a small wait is still slow)."""
    return not _over(gap - waited, median) and waited >= (gap - median) / 2


def thread_stacks(frames: dict[int, FrameType], first: int | None, skip: int) -> list[dict[str, Any]]:
    """Every thread's stack (innermost ``STACK_FRAMES`` frames), the thread ``first`` first."""
    names = {t.ident: t for t in threading.enumerate()}
    order = sorted((ident for ident in frames if ident != skip), key=lambda ident: ident != first)
    stacks = []
    for ident in order[:STACK_THREADS]:
        thread = names.get(ident)
        text = "".join(traceback.format_list(traceback.extract_stack(frames[ident], limit=STACK_FRAMES)))
        stacks.append({"thread": thread.name if thread is not None else f"thread {ident}", "ident": ident,
                       "training": ident == first, "daemon": bool(thread is not None and thread.daemon),
                       "stack": text})
    return stacks


def collective(frame: FrameType | None, distributed: bool = False) -> str | None:
    """The collective this stack waits in: the innermost ``torch.distributed`` function (``all_reduce``,
    ``barrier``...); DistributedDataParallel's own (its forward's buffer broadcast, from
    ``torch/nn/parallel/distributed.py``), as ``DistributedDataParallel.<function>``; and, where
    ``distributed`` (a process group of several ranks), autograd's backward, where DDP's gradient all-reduce
    waits in C++ with no Python frame of its own, as ``backward (DistributedDataParallel gradient all-reduce)``."""
    backward = False
    while frame is not None:
        path = frame.f_code.co_filename.replace("\\", "/")
        name = frame.f_code.co_name
        if "/torch/distributed/" in path and name not in ("wrapper", "_wrapper", "inner"):
            return name
        if path.endswith("/torch/nn/parallel/distributed.py"):
            return f"DistributedDataParallel.{name}"
        if path.endswith("/torch/autograd/graph.py") and name == "_engine_run_backward":
            backward = True
        frame = frame.f_back
    return "backward (DistributedDataParallel gradient all-reduce)" if backward and distributed else None


def this_rank() -> tuple[int, int] | None:
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except Exception:
        return None
    return None


class Heartbeat:
    """The daemon thread: wakes a few times per bound, records one ``stall`` event per silence."""

    def __init__(self, clock: StepClock, context: WatchContext):
        self.clock = clock
        self.context = context  # it holds the watch weakly: the thread must not keep the watch (and model) alive
        floor = clock.stall_after_s or DEFAULT_STALL_AFTER_S
        self.tick = min(1.0, max(0.01, floor / 8))
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    def start(self) -> Heartbeat:
        self.thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.wait(self.tick):
            try:
                if not self.check():
                    return
            except Exception as exc:  # never into the run: one event, and the heartbeat stops
                watch = self.context
                try:
                    if watch.alive:
                        watch.emit(Event("watch-error", watch.step, f"nbguard's stall heartbeat failed and stopped; "
                                         f"the watch and training go on: {type(exc).__name__}: {exc}",
                                         evidence={"exception": repr(exc),
                                                   "traceback": traceback.format_exc(limit=6)}))
                except Exception:
                    pass
                return

    def look_for_save(self, now: float) -> float | None:
        """Is the training thread inside a checkpoint save? Its start (monotonic) if so; the clock keeps the
        time of this look (the step after it is not a step time) and, once the save ends, its seconds."""
        clock = self.clock
        training = sys._current_frames().get(clock.thread) if clock.thread is not None else None
        try:
            save = saving(training)
            if save is None:
                if clock.saving is not None:
                    clock.saves.append((clock.saving["in"], clock.save_seen - clock.saving["since"]))
                    clock.saving = None
                return None
            if clock.saving is None or clock.saving["frame"] != id(save):
                clock.saving = {"in": where(save), "frame": id(save), "since": now, "looks": 0}
            clock.saving["looks"] += 1
            clock.save_seen = now
            return float(clock.saving["since"])
        finally:
            del training

    def check(self) -> bool:
        """One look; False once the watch is gone (the thread then ends)."""
        clock = self.clock
        if not clock.armed or clock.stall is not None:
            return True
        now = time.monotonic()
        bound, how = clock.bound()
        save_since = self.look_for_save(now)
        if save_since is not None:
            # inside a checkpoint save: not a hang unless the save itself lasts SAVE_FACTOR bounds
            silent_since = clock.last_beat
            if now - save_since < SAVE_FACTOR * bound:
                return True
            bound, how = SAVE_FACTOR * bound, f"{SAVE_FACTOR:g} x the bound, inside a checkpoint save"
        else:
            # the silence counts from the last step, forward, or look that saw a save: a save is not silence
            silent_since = max(clock.last_beat, clock.save_seen)
        waited = now - silent_since
        if waited < bound:
            return True
        watch = self.context
        if not watch.alive:
            return False
        frames = sys._current_frames()
        try:
            training = frames.get(clock.thread) if clock.thread is not None else None
            if not self._loop_running(training):
                clock.disarm()  # the loop that stepped returned (an idle kernel, a finished function)
                return True
            if clock.last_beat > silent_since or not clock.armed:
                return True  # a step or a forward came meanwhile
            event = self._event(watch, frames, training, waited, bound, how)
        finally:
            del frames
        clock.stall = (event, silent_since)
        watch.emit(event)
        return True

    def _loop_running(self, training: FrameType | None) -> bool:
        if training is None:
            return False  # the training thread has ended
        loop = self.clock.loop
        if loop is None:
            return True  # no user frame to follow: trust the arming
        frame: FrameType | None = training
        while frame is not None:
            if id(frame) == loop[0] and frame.f_code is loop[1]:
                return True
            frame = frame.f_back
        return False

    def _event(self, watch: WatchContext, frames: dict[int, FrameType], training: FrameType | None, waited: float,
               bound: float, how: str) -> Event:
        clock = self.clock
        stacks = thread_stacks(frames, clock.thread, threading.get_ident())
        waiting_in = where(training) if training is not None else None
        user, _ = innermost_user_frame(training)
        rank = this_rank()
        in_collective = collective(training, distributed=rank is not None and rank[1] > 1)
        after = clock.after_step
        text = (f"no optimizer step completed for {waited:.1f} s "
                + (f"after step {after}" if after is not None else "before the first step")
                + (f" on rank {rank[0]} of {rank[1]}" if rank is not None else "")
                + f" (bound {bound:.3g} s: {how}); the training thread waits in {waiting_in}")
        if user is not None and user is not training:
            text += f", called from {where(user)}"
        if in_collective is not None:
            label = in_collective if in_collective[:1].isupper() or " " in in_collective else \
                f"torch.distributed.{in_collective}"
            text += (f"; it is inside {label}: a collective waits for a rank that does not "
                     f"join it (a rank that crashed, hangs, or took another branch)")
        syncing = weight_sync_frames(training)
        if syncing:  # named before the stacks: the one wait here with no timeout of its own (trl#6796)
            outer, inner = describe(syncing[0]), describe(syncing[-1])
            text += (f"; it is inside TRL's weight sync to the generation engine ({outer}"
                     + (f", in {inner}" if inner != outer else "") + "): the trainer sends the policy's weights to "
                     "vLLM and waits for the server to take them, with no timeout, so a vLLM server that crashed or "
                     "hangs, or an NCCL weight-transfer group that cannot connect, leaves it here for good. Read the "
                     "vLLM server's log; restarting the trainer re-sends every weight")
        text += ". Every thread's stack is on the event (evidence.stacks)"
        evidence: dict[str, Any] = {
            "after_step": after, "waited_s": waited, "bound_s": bound, "bound_from": how, "waiting_in": waiting_in,
            "user_frame": where(user) if user is not None else None, "collective": in_collective, "stacks": stacks}
        if syncing:
            evidence["weight_sync"] = [describe(f) for f in syncing]
        if clock.saving is not None:
            evidence["saving"] = clock.saving["in"]
            text += (f"; the training thread has been inside a checkpoint save ({clock.saving['in']}) for "
                     f"{time.monotonic() - clock.saving['since']:.1f} s: a save that long is a hang too (a full disk, "
                     f"a network filesystem that stopped answering, a rank missing from a collective save)")
        if rank is not None:
            evidence.update(rank=rank[0], world_size=rank[1])
        step = after + 1 if after is not None else 0  # the step it waits for
        return Event(STALL, step, text, evidence=evidence)


def _make(setup: ComponentSetup) -> StepClock:
    return StepClock(setup.settings.after_s)


register_component("stall", _make, settings=StallSettings,
                   aliases={"stall_after_s": "after_s"},
                   summary="the stall heartbeat and the slow-steps check (after_s: the bound's floor, None: off)")
