"""What policy="rewind" costs: snapshot bytes, time per snapshot, and the step-time ratio against skip.

Models: a tiny Llama trained fully (every parameter trainable: the snapshot holds the weights and
AdamW's two moments) and a 24-layer tiny Llama with LoRA adapters (PEFT: only the adapters and their
moments). Variants, one copy of the model each, run interleaved, one step per round in a rotating
order (as ``overhead.py``): no watch, the watch under policy skip, the watch under policy rewind
with a snapshot every ``--every`` steps. Reported per model: bytes per snapshot (and for both slots),
the median time of one snapshot (timed alone, ``--snapshots`` times), the median per-round ratio of
rewind against skip and against no watch, and the snapshot time amortised per step (time / every).

    OMP_NUM_THREADS=1 python benchmarks/rewind_cost.py --rounds 200 --every 50 --clock cpu --threads 1
    python benchmarks/rewind_cost.py --device cuda --rounds 200 --every 50   # pinned buffers, non_blocking
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from overhead import CLOCKS, tiny_batch, tiny_llama, tiny_lora  # noqa: E402

from nbguard.watcher import NanWatch, RewindSettings  # noqa: E402


class Variant:
    def __init__(self, name: str, model: torch.nn.Module, every: int):
        self.name = name
        self.model = model
        self.opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
        self.watch = None
        if name != "no watch":
            policy = "rewind" if name.startswith("rewind") else "skip"
            self.watch = NanWatch(model, optimizer=self.opt, policy=policy,
                                  rewind=RewindSettings(every=every)).attach()
        self.times: list[float] = []

    def step(self, batch, device: str, clock) -> float:
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = clock()
        self.model(**batch).loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return clock() - start


def snapshot_time(variant: Variant, repeats: int, device: str, clock) -> tuple[float, int, int]:
    """Median seconds of one snapshot (``Rewinder.take``, waited on), bytes per snapshot, tensors."""
    watch = variant.watch
    rewinder = watch._rewinder
    times = []
    for _ in range(repeats):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = clock()
        rewinder.take(watch, watch.step)
        for slot in rewinder.slots:
            slot.wait()
        times.append(clock() - start)
    slot = max(rewinder.slots, key=lambda s: s.nbytes)
    return statistics.median(times), slot.nbytes, len(slot.buffers)


def measure(label: str, base: torch.nn.Module, args) -> dict:
    base = base.to(args.device)
    variants = [Variant(name, copy.deepcopy(base), args.every) for name in ("no watch", "skip", "rewind")]
    clock = CLOCKS[args.clock]
    batches = [tiny_batch(s, args.device) for s in range(4)]
    for v in variants:
        for w in range(args.warmup):
            v.step(batches[w % 4], args.device, clock)
    ratios: dict[str, list[float]] = {"rewind/skip": [], "rewind/no watch": [], "skip/no watch": []}
    for r in range(args.rounds):
        order = variants[r % 3:] + variants[:r % 3]
        this = {v.name: v.step(batches[r % 4], args.device, clock) for v in order}
        ratios["rewind/skip"].append(this["rewind"] / this["skip"])
        ratios["rewind/no watch"].append(this["rewind"] / this["no watch"])
        ratios["skip/no watch"].append(this["skip"] / this["no watch"])
        for v in variants:
            v.times.append(this[v.name])
    rewind = variants[2]
    assert rewind.watch is not None and rewind.watch._rewinder.unavailable is None, rewind.watch.summary()
    taken = rewind.watch._rewinder.taken
    snap_s, nbytes, tensors = snapshot_time(rewind, args.snapshots, args.device, clock)
    step_s = statistics.median(variants[1].times)
    for v in variants:
        if v.watch is not None:
            assert [e.kind for e in v.watch.events] == [], v.watch.summary()
            v.watch.detach()
    trainable = sum(p.numel() for p in base.parameters() if p.requires_grad)
    return {"model": label, "trainable": trainable, "tensors": tensors, "bytes": nbytes, "snapshot_s": snap_s,
            "step_s": step_s, "per_step_s": snap_s / args.every, "taken": taken,
            **{k: statistics.median(v) for k, v in ratios.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--snapshots", type=int, default=20, help="snapshots timed alone per model")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--full-layers", type=int, default=4)
    parser.add_argument("--lora-layers", type=int, default=24)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [measure(f"tiny Llama, {args.full_layers} layers, full fine-tune", tiny_llama(args.full_layers), args),
            measure(f"tiny Llama, {args.lora_layers} layers, LoRA r=8", tiny_lora(args.lora_layers), args)]
    print(f"device {args.device}, every {args.every} steps, {args.rounds} rounds, clock {args.clock}")
    print("| model | trainable | tensors | bytes/snapshot | one snapshot | amortised/step | step (skip) "
          "| rewind/skip | rewind/no watch | skip/no watch |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['trainable']:,} | {r['tensors']} | {r['bytes']:,} | {r['snapshot_s'] * 1e3:.3f} ms "
              f"| {r['per_step_s'] * 1e6:.1f} us | {r['step_s'] * 1e3:.2f} ms | {r['rewind/skip']:.3f} "
              f"| {r['rewind/no watch']:.3f} | {r['skip/no watch']:.3f} |")


if __name__ == "__main__":
    main()
