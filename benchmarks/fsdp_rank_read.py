"""Per-step cost of reading each rank's own gradient before FSDP2's reduce-scatter (``fsdp_grads``), on
two ranks: the same FSDP2 run unwatched, watched reading the reduced shards only (the rank of a
non-finite gradient cannot be named), and watched with the pre-reduce read (it can).

Each rank holds three copies of a Llama-shaped model, each ``fully_shard``-ed per decoder layer and at
the root, each with its own AdamW. The post-reduce variant is a watch made while the FSDP internals the
reader needs are made to raise, so it reads as a torch without them would. The variants run interleaved,
one step each per round in a rotating order, both ranks in lockstep (a barrier before each timed step),
so drift on a shared machine hits them alike. Rank 0 reports the median step time of each, the ratio of
medians and the median of the per-round ratios to the unwatched step. ``--time-hooks`` also times the
reader's own work directly (its gradient hooks, the step's flag, the adoption after each forward), which
a loaded machine's wall-time spread can hide; the timers add their own small cost to that variant.

    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node 2 benchmarks/fsdp_rank_read.py --rounds 30
    (add --hidden 64 --vocab 256 --seq-len 32 --rounds 100 for steps where the fixed cost shows)
"""
from __future__ import annotations

import copy
import gc
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddp_overhead import build_model, interleaved, run_arguments  # noqa: E402 - the DDP benchmark's model and step

import nbguard  # noqa: E402
from nbguard.watcher import fsdp_grads  # noqa: E402

VARIANTS = ("unwatched", "watched, post-reduce read", "watched, pre-reduce read")


def shard(model: torch.nn.Module) -> torch.nn.Module:
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def watch_post_reduce(model: torch.nn.Module, opt: torch.optim.Optimizer):
    """A watch that reads the reduced shards only, as on a torch without the internals the reader needs."""
    real = fsdp_grads.fsdp_params

    def absent(model: torch.nn.Module) -> list:
        raise AttributeError("made absent by the benchmark")

    fsdp_grads.fsdp_params = absent
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # its warning says what this variant is
            return nbguard.watch(model, optimizer=opt)
    finally:
        fsdp_grads.fsdp_params = real


def time_reader() -> dict[str, float]:
    """Wrap the reader's work in timers (seconds in total; "steps": the flags taken)."""
    spent = {"hooks": 0.0, "flag": 0.0, "adopt": 0.0, "steps": 0}
    reader = fsdp_grads.PreReduceGrads
    real_hook, real_flag, real_adopt = reader._hook, reader.flag, reader._adopt

    def _hook(self, k):
        hook = real_hook(self, k)

        def timed(param):
            start = time.perf_counter()
            hook(param)
            spent["hooks"] += time.perf_counter() - start
        return timed

    def flag(self, device):
        start = time.perf_counter()
        out = real_flag(self, device)
        spent["flag"] += time.perf_counter() - start
        spent["steps"] += 1
        return out

    def _adopt(self):
        start = time.perf_counter()
        real_adopt(self)
        spent["adopt"] += time.perf_counter() - start

    reader._hook, reader.flag, reader._adopt = _hook, flag, _adopt
    return spent


def main() -> None:
    p = run_arguments(__doc__.split("\n\n")[0], rounds=30)
    p.add_argument("--time-hooks", action="store_true", help="also time the reader's own work directly")
    args = p.parse_args()
    spent = time_reader() if args.time_hooks else None
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    base = build_model(args)
    variants = {}
    for name in VARIANTS:
        model = shard(copy.deepcopy(base))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        watch = None
        if name == VARIANTS[1]:
            watch = watch_post_reduce(model, opt)
        elif name == VARIANTS[2]:
            watch = nbguard.watch(model, optimizer=opt)
        if watch is not None:
            assert watch._ranks.pre_reduce.available == (name == VARIANTS[2])
        variants[name] = (model, opt, watch)
    times, ratios = interleaved(variants, args, rank)
    hooked = 0
    for _, _, watch in variants.values():
        if watch is not None:
            assert watch.events == [], watch.summary()  # a healthy run raises no alarm
            reader = watch._ranks.pre_reduce
            hooked = max(hooked, sum(h is not None for h in reader._hooked))
            watch.detach()
    if rank == 0:
        base_step = statistics.median(times[VARIANTS[0]])
        params = sum(p.numel() for p in base.parameters())
        print(f"\n{params / 1e6:.1f}M parameters ({hooked} unsharded parameters hooked), FSDP2 on 2 ranks "
              f"(gloo, CPU), batch {args.batch_size} x {args.seq_len} per rank, {args.rounds} rounds")
        print("| variant | median step | ratio of medians | median per-round ratio |\n|---|---:|---:|---:|")
        for name in VARIANTS:
            step = statistics.median(times[name])
            print(f"| FSDP2, {name} | {step * 1e3:.1f} ms | {step / base_step:.3f}x | "
                  f"{statistics.median(ratios[name]):.3f}x |")
        if spent is not None and spent["steps"]:
            per_step = {k: spent[k] / spent["steps"] * 1e3 for k in ("hooks", "flag", "adopt")}
            print(f"\nthe pre-reduce reader's own work per step on rank 0 ({spent['steps']:.0f} steps, warm-up "
                  f"included): hooks {per_step['hooks']:.2f} ms, flag {per_step['flag']:.2f} ms, adoption "
                  f"{per_step['adopt']:.2f} ms; {sum(per_step.values()) / base_step / 1e3:.1%} of the unwatched "
                  f"median step")
    variants.clear()
    gc.collect()  # the FSDP copies and the watches go before the process group does
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
