"""How long the gradient heatmap PNG takes for a large history (200 groups x 2,000 steps).

The history is a v1 document section exactly as a watch writes it (JSON lists, "nan"/"inf"
strings, nulls, skipped steps). Timed: heatmap_png() from that section to PNG bytes, median of
several runs after one warm-up (which pays matplotlib's import). Target: well under a second.

    cd /work/main && OMP_NUM_THREADS=1 .venv/bin/python benchmarks/heatmap_render.py [--png out.png]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from nbguard.findings import document
from nbguard.render import heatmap_png, mime_bundle

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def large_history(n_groups: int = 200, n_steps: int = 2000, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    groups = [f"model.layers.{i // len(LINEARS)}.{LINEARS[i % len(LINEARS)]}" for i in range(n_groups)]
    grid = np.exp(rng.normal(0.0, 1.0, (n_groups, n_steps))).tolist()
    grid[57][1234] = "nan"  # one bad cell among 400,000 must stay visible
    grid[3][1500] = "inf"
    for row in grid:
        row[-1] = None  # the step still being written
    return {
        "groups": groups,
        "steps": list(range(n_steps)),
        "grad_norm": grid,
        "skipped_steps": [100, 101, 102, 1700],
        "loss": np.linspace(3.0, 1.0, n_steps).tolist(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=200)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--png", help="also write the PNG here")
    args = parser.parse_args()

    history = large_history(args.groups, args.steps)
    png = heatmap_png(history)  # warm-up: imports matplotlib, builds colormaps
    times, cpu = [], []  # wall clock, and this thread's CPU time (steady on a busy shared machine)
    for _ in range(args.runs):
        start, start_cpu = time.perf_counter(), time.thread_time()
        png = heatmap_png(history)
        times.append(time.perf_counter() - start)
        cpu.append(time.thread_time() - start_cpu)
    bundle_times = []
    doc = document("watch", history=history)
    for _ in range(3):
        start = time.perf_counter()
        mime_bundle(doc)  # what every display of a watch costs: redaction, text, HTML, heatmap + series PNGs
        bundle_times.append(time.perf_counter() - start)
    if args.png:
        with open(args.png, "wb") as fh:
            fh.write(png)
    print(f"heatmap_png {args.groups} groups x {args.steps} steps: median {statistics.median(times) * 1000:.0f} ms "
          f"(min {min(times) * 1000:.0f}, max {max(times) * 1000:.0f}, {args.runs} runs; CPU time median "
          f"{statistics.median(cpu) * 1000:.0f} ms), PNG {len(png) / 1024:.0f} KiB")
    print(f"mime_bundle of the watch document (heatmap and series PNGs included): "
          f"median {statistics.median(bundle_times) * 1000:.0f} ms (3 runs)")


if __name__ == "__main__":
    main()
