"""The multi-rank tests' hang guard judges progress, not wall time: a launch whose processes sleep (ranks
waiting in a collective) is stopped as hung, a launch that is only slow (it keeps using the CPU) finishes."""
from __future__ import annotations

import sys
import time

import pytest
from ddp_helpers import _run_once


def test_a_launch_that_stops_using_the_cpu_is_stopped_as_hung():
    started = time.monotonic()
    with pytest.raises(AssertionError, match="hung.*of CPU in 6 s"):
        _run_once([sys.executable, "-c", "import time; print('waiting', flush=True); time.sleep(600)"], stall=6)
    assert time.monotonic() - started < 120  # stopped soon after the stall, not at the sleep's end


def test_a_launch_that_keeps_working_longer_than_the_stall_finishes():
    # a child process spins for 15 s: slow, not hung (its CPU time grows all along)
    spin = ("import subprocess, sys; subprocess.run([sys.executable, '-c', "
            "'import time\\nend = time.monotonic() + 15\\nwhile time.monotonic() < end: pass']); print('done')")
    done = _run_once([sys.executable, "-c", spin], stall=6)
    assert done.returncode == 0 and "done" in done.stdout


def test_a_launch_that_never_ends_is_stopped_at_the_hard_limit(monkeypatch):
    import ddp_helpers

    monkeypatch.setattr(ddp_helpers, "HARD_LIMIT_FACTOR", 2)
    with pytest.raises(AssertionError, match="still running after"):
        _run_once([sys.executable, "-c", "while True: pass"], stall=5)
