"""Where the watch's fixed cost goes inside a real training step, by sampling (py-spy), not by timers.

Timers around each hook change what they time, and an A/B of one piece against another is lost in the
spread between model copies (unwatched copies differ by up to 0.8% here: ``overhead.py --copy-spread``).
A sampling profiler looks at the step as it runs: this script trains the 4-layer tiny Llama of ``overhead.py --fixed-cost``
with the watch (fused read) under ``py-spy record`` and counts the samples that fall in the watch's own
code, by the hook they entered through, and the detectors' share of them. Then, for scale, the same
detectors judge a thousand steps in a hot loop: the time the same Python takes when it is the only
work (the training step's tensors evict the interpreter's state from the caches between two calls).

A sample counts as the watch's when its innermost nbguard frame is doing nbguard work: not calling
through to the user's work (the model's forward, the optimizer's step, ``zero_grad``, torch's clip)
and not in ``_clip_norms``, which computes the clip's norms in torch's place (the same work an unwatched
clip does). Needs py-spy (``pip install py-spy``). It samples blocking (the process is paused for
each sample, off its thread clock): with ``--nonblocking`` about a tenth of the samples fail to read,
most of them in Python-heavy code, which then undercounts the watch (py-spy's own count of samples and
errors is printed with the results).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/attribute.py --steps 3000
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

# the innermost nbguard frame calls into the user's own work: time an unwatched step spends too
USERS_WORK = ("can_return_tuple", "Adam.step", "clip_grad.py", "_disable_dynamo", "Module._call_impl",
              "Optimizer.zero_grad", "_use_grad")
PASS_THROUGH = ("hook", "guarded_call")  # the guard's wrappers: the hook they call names the entry point
DETECTORS_JUDGING = ("DetectorBoard.run", "DetectorBoard.reset_step")  # update, before_update, reset_step
DETECTORS_SCALARS = ("DetectorBoard.collect", "DetectorBoard.on_micro_batch")  # the token count, the fingerprint


def watched_tiny_llama():
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from overhead import FixedCostVariant, tiny_batch, tiny_llama

    torch.set_num_threads(1)
    variant = FixedCostVariant("fused read", tiny_llama(4))
    batch = tiny_batch()
    variant.run(batch, 20, time.thread_time)
    return variant, batch


def train(steps: int) -> None:
    """The profiled child: the watched tiny Llama, warmed up, then ``steps`` steps; prints the step time."""
    variant, batch = watched_tiny_llama()
    print(f"step {variant.run(batch, steps, time.thread_time) * 1e6:.1f} us")


def judging_in_a_hot_loop(steps: int = 1000) -> float:
    """Seconds per step for the board's ``before_update``, ``update`` and ``reset_step`` on the watch's own
    detectors, step after step with nothing in between (views with the trained model's groups and norms)."""
    from nbguard.watcher.core.pipeline import StepView

    variant, _ = watched_tiny_llama()
    watch = variant.watch
    board, groups = watch._board, tuple(watch.history.groups)
    norms = [watch.history.grad_norm(group)[-1] or 0.0 for group in groups]  # the last trained step's
    views = [StepView(watch.step + i, groups, tuple(v * (1 + 0.01 * (i % 7)) for v in norms), 5.0, None, False,
                      history=watch.history) for i in range(steps)]
    start = time.thread_time()
    for view in views:
        board.run("before_update", view, None, lambda detector, event: None)
        board.run("update", view, None, lambda detector, event: None)
        board.reset_step()
    return (time.thread_time() - start) / steps


def function(frame: str) -> str:
    return frame.split(" (")[0]


def attribute(raw: Path) -> tuple[int, Counter, Counter]:
    """(samples inside the training loop, watch samples by entry hook, watch samples: detectors or not)."""
    total, by_entry, by_part = 0, Counter(), Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if not any(function(f) == "FixedCostVariant.run" for f in frames):
            continue  # model building, warm-up imports
        total += int(count)
        ours = [i for i, f in enumerate(frames) if "nbguard/" in f]
        if not ours:
            continue
        innermost = ours[-1]
        callee = frames[innermost + 1] if innermost + 1 < len(frames) else ""
        names = [function(frames[i]).rsplit(".", 1)[-1] for i in ours]
        if any(w in callee for w in USERS_WORK) or "_clip_norms" in names:
            continue
        entry = next((n for n in names if n not in PASS_THROUGH), names[0])
        by_entry[entry] += int(count)
        functions = {function(frames[i]) for i in ours}
        by_part["the detectors judging the step (the board's run, reset_step)" if functions & set(DETECTORS_JUDGING)
                else "the detectors' device scalars (the board's collect, on_micro_batch)"
                if functions & set(DETECTORS_SCALARS) else "the rest of the watch"] += int(count)
    return total, by_entry, by_part


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--rate", type=int, default=100, help="py-spy samples per second")
    parser.add_argument("--nonblocking", action="store_true",
                        help="sample without pausing the process (py-spy --nonblocking): the comparison that "
                             "shows why the default pauses (failed reads, fewer samples in the watch)")
    parser.add_argument("--train", action="store_true", help=argparse.SUPPRESS)  # the profiled child
    args = parser.parse_args(argv)
    if args.train:
        train(args.steps)
        return
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(py_spy).exists():
        parser.error("py-spy is not installed: pip install py-spy")
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "watch.raw"
        child = subprocess.run([py_spy, "record", "-r", str(args.rate), "-f", "raw", "-o", str(raw),
                                *(["--nonblocking"] if args.nonblocking else []),
                                "--", sys.executable, __file__, "--train", "--steps", str(args.steps)],
                               capture_output=True, text=True, check=True)
        errors = next((line[line.index("Samples:"):].strip() for line in (child.stdout + child.stderr).splitlines()
                       if "Samples:" in line), "no sample count printed")
        step_us = float(next(line.split()[1] for line in child.stdout.splitlines() if line.startswith("step ")))
        total, by_entry, by_part = attribute(raw)
    watch = sum(by_entry.values())
    print(f"\n### the watch's share of a tiny-Llama step, sampled ({args.steps} steps, "
          f"{'nonblocking' if args.nonblocking else 'blocking'}, {total} samples in the loop, step "
          f"{step_us / 1e3:.2f} ms; py-spy: {errors})\n")
    print(f"the watch's own code: {watch} samples, {watch / total:.2%} of the step, about "
          f"{watch / total * step_us:.0f} us per step\n")
    print("| entered through | samples | per step |\n|---|---:|---:|")
    for name, n in by_entry.most_common():
        print(f"| {name} | {n} | {n / total * step_us:.0f} us |")
    print("\n| part | samples | per step |\n|---|---:|---:|")
    for name, n in by_part.most_common():
        print(f"| {name} | {n} | {n / total * step_us:.0f} us |")
    print(f"\nthe same detectors judging a step in a hot loop: {judging_in_a_hot_loop() * 1e6:.1f} us per step")


if __name__ == "__main__":
    main()
