"""How long the training thread waited for a CPU: the part of a step a loaded machine adds.

Linux keeps, for every thread, the time it was ready to run but waited on a run queue for a core
(``/proc/thread-self/schedstat``, its second field, in nanoseconds). A step slowed by other processes
taking the cores (a neighbour on a shared machine, CI lanes and CPU burners beside the tests) shows
there; a step slowed by its own work (a recompile, a CPU fallback, a dataloader that blocks or sleeps, a
wait on the device) does not: the thread computes, sleeps or blocks, it does not queue.

The training thread's wait only: the other threads' waits are not on the step's path (an idle torch
intra-op thread spinning on a loaded machine queues too; summed in, 0.19 s of theirs hid a recompile
storm's 0.1 s compiles). Torch's intra-op threads on a loaded machine make the training thread spin at
their barrier while one of them queues, and that spin stays counted as its own (the tests, like
``make``, run with ``OMP_NUM_THREADS=1``: none there).

A reading is one small file read (microseconds): the step clock takes it only around steps already over
the slow-steps threshold, never on an ordinary step. Where there is no such file (macOS, Windows, a
kernel without schedstats) a reading is None and steps are judged on their time alone.
"""
from __future__ import annotations

SCHEDSTAT = "/proc/thread-self/schedstat"


def cpu_wait_ns() -> int | None:
    """Nanoseconds the calling thread has waited for a CPU since it started; None where unknown."""
    try:
        with open(SCHEDSTAT, "rb") as f:
            return int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
