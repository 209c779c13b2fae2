"""The tests make check leaves out: those over a time limit in a profiled run (a JUnit XML from pytest).

    python tests/lanes/profile.py RUN.xml [MORE.xml ...] [--over 2.0] [--write tests/lanes/slow_tests.txt]
        [--write-files tests/lanes/file_seconds.txt]

Prints the slowest tests and files (the figures docs/contributing.md quotes) and, with --write, writes the
node ids of every test that took longer than --over seconds, one a line. tests/conftest.py marks those
``profiled_slow``; ``make check`` runs the rest: the inner loop's fast tests, in a few minutes. With
--write-files, the seconds of each file, longest first: tests/conftest.py hands the files to --dist loadfile's
workers in that order, so no long file starts last while the other worker idles.
"""
from __future__ import annotations

import argparse
import collections
import xml.etree.ElementTree as ET
from pathlib import Path


def durations(xml_path: str) -> dict[str, float]:
    """Node id -> seconds (setup, call and teardown together, as JUnit's time attribute holds them). A test that
    failed or errored counts as infinitely slow: its time says nothing of how long it takes when it passes."""
    out: dict[str, float] = {}
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        broke = case.find("failure") is not None or case.find("error") is not None
        module = case.get("classname", "").replace(".", "/")
        path = module + ".py" if not module.endswith(".py") else module
        # classname "tests.test_x" or "tests.test_x.TestClass": the file is the longest prefix that exists
        parts = case.get("classname", "").split(".")
        for cut in range(len(parts), 0, -1):
            candidate = "/".join(parts[:cut]) + ".py"
            if Path(candidate).exists():
                path = candidate + "".join(f"::{p}" for p in parts[cut:])
                break
        node = f"{path}::{case.get('name')}"
        out[node] = float("inf") if broke else out.get(node, 0.0) + float(case.get("time", 0))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("xml", nargs="+", help="pytest --junitxml files (of different lanes: their tests add up)")
    parser.add_argument("--over", type=float, default=2.0, help="seconds past which a test is slow (default 2)")
    parser.add_argument("--write", help="write the slow tests' node ids here")
    parser.add_argument("--write-files", help="write each file's seconds here ('SECONDS PATH' a line, longest first)")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    times = {node: seconds for xml in args.xml for node, seconds in durations(xml).items()}
    by_file: dict[str, float] = collections.Counter()
    for node, seconds in times.items():
        if seconds != float("inf"):
            by_file[node.split("::")[0]] += seconds
    total = sum(t for t in times.values() if t != float("inf"))
    print(f"{len(times)} tests, {total:.0f} s in all")
    print(f"\nslowest {args.top} tests:")
    for node, seconds in sorted(((n, t) for n, t in times.items() if t != float("inf")), key=lambda kv: -kv[1])[
            : args.top]:
        print(f"{seconds:8.1f} s  {node}")
    print(f"\nslowest {args.top} files:")
    for path, seconds in collections.Counter(by_file).most_common(args.top):
        print(f"{seconds:8.1f} s  {path}")
    slow = sorted(node for node, seconds in times.items() if seconds > args.over)
    fast_total = sum(seconds for node, seconds in times.items() if seconds <= args.over)
    print(f"\nover {args.over} s or broken: {len(slow)} tests ({total - fast_total:.0f} s); the rest: "
          f"{len(times) - len(slow)} tests, {fast_total:.0f} s")
    if args.write:
        Path(args.write).write_text("".join(f"{node}\n" for node in slow))
    if args.write_files:
        Path(args.write_files).write_text(
            "".join(f"{seconds:.1f} {path}\n" for path, seconds in collections.Counter(by_file).most_common()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
