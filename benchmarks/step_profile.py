"""Where the watch's per-step time goes on the 15M full fine-tune (issue 45): cProfile over watched steps.

The default mode's Llama of ``overhead.py`` (``--layers 2``: 14.7M parameters, all trainable), batch 4 x 128,
AdamW, ``nbguard.watch`` with every default; after a warm-up, ``--steps`` steps run under cProfile with this
thread's CPU clock. Printed: the step's total, nbguard's own work (the own time of every function of the package, plus the
built-ins, torch's ops among them, that it calls directly), and those rows, most first. Time in the user's
code that nbguard's wrappers call (the optimizer's step, the forward) is not counted.

    OMP_NUM_THREADS=1 python benchmarks/step_profile.py --steps 8 --threads 1
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from overhead import build_model, make_batch  # noqa: E402

import nbguard  # noqa: E402

PACKAGE = str(Path(nbguard.__file__).resolve().parent)


def watched_steps(model, opt, steps: int, first_seed: int) -> None:
    for step in range(steps):
        model(**make_batch(ARGS, first_seed + step)).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def inside_nbguard(stats: pstats.Stats) -> list[tuple[float, int, str]]:
    """nbguard's functions by their own time, and the functions they call directly (torch's ops, which do
    the work) by the time spent in them when called from nbguard, less what they call back into nbguard."""
    raw = stats.stats  # type: ignore[attr-defined]
    rows = []
    for (path, line, name), (_, calls, own, _cumulative, callers) in raw.items():
        if path.startswith(PACKAGE):
            rows.append((own, calls, f"{Path(path).relative_to(PACKAGE)}:{line} {name}"))
            continue
        ours = [t for caller, t in callers.items() if caller[0].startswith(PACKAGE)]
        if ours and path == "~":  # a built-in (torch's ops are): its whole time is work nbguard asked for
            rows.append((sum(t[3] for t in ours), sum(t[1] for t in ours), f"(called by nbguard) {name}"))
    rows.sort(reverse=True)
    return rows


def main(argv=None) -> None:
    global ARGS
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--top", type=int, default=25)
    ARGS = parser.parse_args(argv)
    ARGS.hidden, ARGS.vocab, ARGS.seq_len, ARGS.batch_size, ARGS.device = 512, 8192, 128, 4, "cpu"
    if ARGS.threads:
        torch.set_num_threads(ARGS.threads)
    model = build_model(ARGS)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    watch = nbguard.watch(model, optimizer=opt)
    watched_steps(model, opt, ARGS.warmup, 0)
    profiler = cProfile.Profile(time.thread_time)
    start = time.thread_time()
    profiler.runcall(watched_steps, model, opt, ARGS.steps, ARGS.warmup)
    total = (time.thread_time() - start) / ARGS.steps
    assert watch.events == [], watch.summary()
    watch.detach()
    rows = inside_nbguard(pstats.Stats(profiler))
    top = sum(own for own, _, _ in rows)
    print(f"\n### nbguard's time per step ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
          f"{ARGS.steps} steps under cProfile, thread CPU clock)\n")
    print(f"step (profiled): {total * 1e3:.1f} ms; nbguard's own work: {top / ARGS.steps * 1e3:.2f} ms "
          f"({top / ARGS.steps / total:.1%})\n")
    print("| own time per step | calls per step | function |\n|---:|---:|---|")
    for own, calls, name in rows[:ARGS.top]:
        print(f"| {own / ARGS.steps * 1e3:.3f} ms | {calls / ARGS.steps:.1f} | `{name}` |")


if __name__ == "__main__":
    main()
