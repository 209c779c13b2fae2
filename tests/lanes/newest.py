"""The newest-releases lane (make test-newest) and the lock of the main lane (make lock).

``--lock FILE --out DIR -- CMD``: the versions this interpreter has that differ from the lock, then
CMD (the suite) with its output in DIR/pytest.log; DIR/summary.txt says what changed and which tests
failed. Drift is information, not a gate: the exit status is 0 unless the lane itself could not run.
``--write-lock FILE``: this interpreter's versions as the main lane's lock.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

HEADER = """\
# The main lane's lock: the versions `make test` installs (pip -c), so a clean clone installs what passed.
# Written by `make lock` from the newest-releases lane (.venv-newest); `make test-newest` reports how the
# newest releases differ from it and what fails there. torch is installed first, pinned in the Makefile.
"""


def installed() -> dict[str, str]:
    """name -> version for every distribution in this interpreter, nbguard's own checkout left out."""
    out = subprocess.run([sys.executable, "-m", "pip", "freeze", "--exclude-editable"], check=True,
                         capture_output=True, text=True).stdout
    pins = {}
    for line in out.splitlines():
        name, sep, version = line.partition("==")
        if sep and name.lower() != "nbguard":
            pins[name.lower()] = version.split("+")[0]  # torch's local label (+cpu) is the build, not the release
    return pins


def read_lock(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        name, sep, version = line.split("#")[0].strip().partition("==")
        if sep:
            pins[name.lower()] = version
    return pins


def drift(lock: dict[str, str], now: dict[str, str]) -> list[str]:
    lines = [f"{n}: {lock[n]} -> {now[n]}" for n in sorted(lock.keys() & now.keys()) if lock[n] != now[n]]
    lines += [f"{n}: new, {now[n]}" for n in sorted(now.keys() - lock.keys())]
    lines += [f"{n}: gone (was {lock[n]})" for n in sorted(lock.keys() - now.keys())]
    return lines


def run_lane(lock_path: Path, out: Path, command: list[str]) -> int:
    out.mkdir(parents=True, exist_ok=True)
    changes = drift(read_lock(lock_path), installed())
    log = out / "pytest.log"
    with log.open("w") as f:
        code = subprocess.call(command, stdout=f, stderr=subprocess.STDOUT)
    text = log.read_text()
    failed = sorted(set(re.findall(r"^(?:FAILED|ERROR) (\S+)", text, flags=re.M)))
    counts = re.findall(r"(\d+) (passed|failed|errors?|skipped)", text.splitlines()[-1] if text else "")
    summary = [f"newest-releases lane (information, not a gate): pytest exit {code}",
               "counts: " + (", ".join(f"{k}={n}" for n, k in counts) or "none read"),
               f"versions that differ from {lock_path} ({len(changes)}):", *[f"  {c}" for c in changes],
               f"tests that fail on the newest releases ({len(failed)}):", *[f"  {t}" for t in failed],
               f"full output: {log}"]
    (out / "summary.txt").write_text("\n".join(summary) + "\n")
    print("\n".join(summary), flush=True)
    return 0 if code in (0, 1) else code  # 1: tests failed (drift); anything else: the lane did not run


def write_lock(path: Path) -> None:
    pins = installed()
    pins.pop("pip", None)
    path.write_text(HEADER + "".join(f"{n}=={v}\n" for n, v in sorted(pins.items())))
    print(f"wrote {len(pins)} pins to {path}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lock", type=Path, help="the main lane's lock, to compare against")
    parser.add_argument("--out", type=Path, default=Path("build/newest"))
    parser.add_argument("--write-lock", type=Path, help="write this interpreter's versions as the lock")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the test command")
    args = parser.parse_args()
    if args.write_lock:
        write_lock(args.write_lock)
        return 0
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.lock is None or not command:
        parser.error("give --lock FILE and, after --, the test command (or --write-lock FILE)")
    if not args.lock.is_file():
        parser.error(f"no lock at {args.lock}: run make lock first")
    return run_lane(args.lock, args.out, command)


if __name__ == "__main__":
    sys.exit(main())
