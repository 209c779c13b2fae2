"""Run a test command with every core busy, RUNS times in a row (make test-loaded).

Multi-rank verdicts must not depend on timing: a rank that is slow to reach a collective, a launcher
slow to fork, a kernel slow to answer must not change what the tests see. One burner process per
core spins for the whole run; the burners are stopped however the run ends, and their CPU time is
printed so a run that was not really loaded shows it.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

BURN = "while True: pass"


def start_burners(count: int, nice: int = 0) -> list[subprocess.Popen]:
    """``count`` spinning processes; ``nice`` > 0 lowers their priority, so they take only the CPU that
    the rest of the machine leaves idle (make test runs another lane beside this one: real load)."""
    return [subprocess.Popen([sys.executable, "-c", BURN], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, preexec_fn=(lambda: os.nice(nice)) if nice else None)
            for _ in range(count)]


def burner_cpu_seconds(burners: list[subprocess.Popen]) -> list[float]:
    """Each burner's CPU time so far, from /proc (utime + stime, in clock ticks)."""
    ticks = os.sysconf("SC_CLK_TCK")
    out = []
    for b in burners:
        try:
            fields = open(f"/proc/{b.pid}/stat").read().rsplit(")", 1)[1].split()
            out.append((int(fields[11]) + int(fields[12])) / ticks)
        except (OSError, IndexError, ValueError):
            out.append(float("nan"))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1, help="how many times in a row (default 1)")
    parser.add_argument("--burners", type=int, default=os.cpu_count() or 2,
                        help="busy processes to start (default: one per core)")
    parser.add_argument("--nice", type=int, default=0,
                        help="the burners' niceness (default 0: they compete with the tests for every core; "
                             "19: they only fill the cores that another lane running beside leaves idle)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the test command")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the test command after --")
    if args.runs < 1 or args.burners < 1:
        parser.error("--runs and --burners must be at least 1")
    if not 0 <= args.nice <= 19:
        parser.error("--nice must be between 0 and 19")
    burners = start_burners(args.burners, args.nice)
    started = time.monotonic()
    try:
        for run in range(1, args.runs + 1):
            t0 = time.monotonic()
            code = subprocess.call(command)
            print(f"test-loaded: run {run} of {args.runs} with {args.burners} burners (nice {args.nice}): exit {code} "
                  f"in {time.monotonic() - t0:.0f} s", flush=True)
            if code != 0:
                return code
    finally:
        busy = burner_cpu_seconds(burners)
        for b in burners:
            b.kill()
            b.wait()
        wall = time.monotonic() - started
        print(f"test-loaded: burners' CPU time {', '.join(f'{s:.0f} s' for s in busy)} over {wall:.0f} s of wall time",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
