"""What ``nbguard.watch(..., log_to=tracker)`` adds per step at the default rate (every 10 steps).

Two variants, each with its own copy of a Llama-shaped model (hidden 256, 2 layers, vocab 4096) and
AdamW, batch 4 x 64, fwd + bwd + step, one step each per round in alternating order, one process:
``nbguard.watch`` alone, and ``nbguard.watch(..., log_to=...)`` with a TensorBoard SummaryWriter
(or an offline W&B run). ``--clock cpu`` counts the thread's CPU time (valid with one torch thread
on CPU); the tracker's own background writer threads are outside it, and reported by ``--clock wall``.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/tracker_cost.py --rounds 60 --clock cpu
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing


def build():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2))


def tracker(kind: str, root: str):
    if kind == "tensorboard":
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(root)
    os.environ.update(WANDB_MODE="offline", WANDB_DIR=root, WANDB_SILENT="true")
    import wandb

    return wandb.init(project="nbguard-bench")


def main(argv=None) -> None:
    import nbguard

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    parser.add_argument("--tracker", choices=("tensorboard", "wandb"), default="tensorboard")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    base = build()
    batch = {"input_ids": torch.randint(0, 4096, (4, 64), generator=torch.Generator().manual_seed(1))}
    batch["labels"] = batch["input_ids"].clone()
    run = tracker(args.tracker, tempfile.mkdtemp())
    variants = {}
    for name, log_to in (("watch", None), ("watch + log_to", run)):
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        watch = nbguard.watch(model, optimizer=opt, verify=False, log_to=log_to)
        variants[name] = (model, opt, watch, [])

    def step(model, opt) -> float:
        start = clock()
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return clock() - start

    for i in range(args.warmup + args.rounds):
        order = list(variants) if i % 2 == 0 else list(reversed(variants))
        for name in order:
            model, opt, _watch, times = variants[name]
            elapsed = step(model, opt)
            if i >= args.warmup:
                times.append(elapsed)
    base_times = variants["watch"][3]
    logged_times = variants["watch + log_to"][3]
    per_round = [b / a for a, b in zip(base_times, logged_times)]
    print(f"tracker={args.tracker} clock={args.clock} rounds={args.rounds} (log every 10 steps: "
          f"{len(range(0, args.warmup + args.rounds, 10))} logged steps)")
    for name, (_m, _o, _watch, times) in variants.items():
        print(f"{name:16s} median {statistics.median(times) * 1e3:8.2f} ms  mean {statistics.fmean(times) * 1e3:8.2f} ms")
    print(f"ratio of medians {statistics.median(logged_times) / statistics.median(base_times):.3f}x; "
          f"median per-round ratio {statistics.median(per_round):.3f}x; "
          f"ratio of means {statistics.fmean(logged_times) / statistics.fmean(base_times):.3f}x (the logged steps included)")
    for _m, _o, watch, _t in variants.values():
        watch.detach()
    getattr(run, "close", getattr(run, "finish", None))()


if __name__ == "__main__":
    main()
