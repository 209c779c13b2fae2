"""Per-step cost of the watch in a two-rank DDP run, against the same DDP run without it, and the
localisation time on the bad rank.

Each rank holds three copies of a Llama-shaped model, each in its own DDP wrapper with its own AdamW:
one unwatched (baseline), one with ``nbguard.watch`` (which reads each rank's own gradient in DDP's
communication hook, one fused norm per bucket), and one whose DDP already has a communication hook
(torch's default ``allreduce_hook``, registered as a user would), so that the watch falls back to a
hook and a norm per parameter. They run interleaved, one step each per round in a rotating order, on
both ranks in lockstep (a barrier before each timed step), so drift on a shared machine hits them
alike. Reported by rank 0: median step time of each, the ratio of medians and the median of the
per-round ratios. Then a NaN is planted in one weight on rank 1 only and the
bad step is timed on both ranks, with the replay time of the bad rank.

    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node 2 benchmarks/ddp_overhead.py --rounds 20
    (add --hidden 64 --vocab 256 --seq-len 32 --rounds 300 for steps where the fixed cost shows)
"""
from __future__ import annotations

import argparse
import copy
import gc
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import nbguard  # noqa: E402


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
                         num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=8,
                         max_position_embeddings=args.seq_len, attn_implementation="sdpa")
    return LlamaForCausalLM(config)


def make_batch(args: argparse.Namespace, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, args.vocab, (args.batch_size, args.seq_len), generator=gen)
    return {"input_ids": ids, "labels": ids.clone()}


def timed_step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: dict) -> float:
    dist.barrier()  # both ranks start the step together: the time is the step's, not the wait for a peer
    start = time.perf_counter()
    model(**batch).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def interleaved(variants: dict, args: argparse.Namespace, rank: int) -> tuple[dict, dict]:
    """Warm each variant (name -> (model, optimizer, watch)) up, then time one step of each per round in a
    rotating order, so drift on a shared machine hits them alike. Each step's time, and its ratio to the
    first variant's step of the same round."""
    batches = [make_batch(args, 1000 * rank + s) for s in range(4)]
    for model, opt, _ in variants.values():
        for w in range(args.warmup):
            timed_step(model, opt, batches[w % len(batches)])
    names = list(variants)
    times: dict[str, list[float]] = {n: [] for n in names}
    ratios: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        this_round = {n: timed_step(*variants[n][:2], batches[r % len(batches)]) for n in order}
        for n, t in this_round.items():
            times[n].append(t)
            ratios[n].append(t / this_round[names[0]])
        if rank == 0:
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{k} {t * 1e3:.0f} ms" for k, t in this_round.items()),
                  file=sys.stderr)
    return times, ratios


def overhead(args: argparse.Namespace, rank: int) -> dict:
    base = build_model(args)
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    variants = {}
    for name in ("baseline", "nbguard watch", "nbguard watch, hook per parameter"):
        model = DDP(copy.deepcopy(base))
        if name.endswith("per parameter"):
            model.register_comm_hook(None, allreduce_hook)  # DDP takes one hook: the watch cannot add its own
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        watch = nbguard.watch(model, optimizer=opt) if name != "baseline" else None
        if watch is not None:
            assert watch._collector.bucketed == (not name.endswith("per parameter"))
        variants[name] = (model, opt, watch)
    times, ratios = interleaved(variants, args, rank)
    for _, _, watch in variants.values():
        if watch is not None:
            assert watch.events == [], watch.summary()  # a healthy run raises no alarm
            watch.detach()
    return {"times": times, "ratios": ratios, "params": sum(p.numel() for p in base.parameters())}


def localisation(args: argparse.Namespace, rank: int) -> dict:
    """NaN in one weight of rank 1's replica only (DDP broadcast the weights at wrap time, not after)."""
    model = DDP(build_model(args))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    watch = nbguard.watch(model, optimizer=opt, policy="skip")
    target = f"model.layers.{args.layers // 2}.mlp.down_proj"
    batches = [make_batch(args, 1000 * rank + s) for s in range(4)]
    step_times = []
    for step in range(4):
        if step == 2 and rank == 1:
            with torch.no_grad():
                model.module.get_submodule(target).weight[0, 0] = float("nan")
        step_times.append(timed_step(model, opt, batches[step]))
    event = next(e for e in watch.events if e.kind in ("nonfinite-loss", "nonfinite-grad"))
    assert event.rank == 1 and event.origins and event.origins[0].module.startswith(target), event
    watch.detach()
    return {"bad_step": step_times[2], "healthy_step": statistics.median(step_times[:2]),
            "replay_seconds": event.evidence.get("replay_seconds"), "module": event.origins[0].module,
            "cause": event.cause}


def run_arguments(description: str, rounds: int) -> argparse.ArgumentParser:
    """The options of a two-rank benchmark run: rounds, warm-up steps, the model's and the batch's shape."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--rounds", type=int, default=rounds)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    return p


def main() -> None:
    args = run_arguments(__doc__.split("\n\n")[0], rounds=20).parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    result = overhead(args, rank)
    found = localisation(args, rank)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, found)
    if rank == 0:
        base = statistics.median(result["times"]["baseline"])
        print(f"\n{result['params'] / 1e6:.1f}M parameters, 2 ranks (gloo, CPU), batch {args.batch_size} x "
              f"{args.seq_len} per rank, {args.rounds} rounds")
        print("| variant | median step | ratio of medians | median per-round ratio |\n|---|---:|---:|---:|")
        for name, times in result["times"].items():
            step = statistics.median(times)
            print(f"| DDP + {name} | {step * 1e3:.1f} ms | {step / base:.3f}x | "
                  f"{statistics.median(result['ratios'][name]):.3f}x |")
        bad = gathered[1]
        print(f"\nlocalisation: NaN planted in {bad['module']} on rank 1 -> named on every rank "
              f"({bad['cause']}); replay on rank 1 {bad['replay_seconds'] * 1e3:.0f} ms; bad step "
              f"{bad['bad_step'] * 1e3:.0f} ms on rank 1 / {gathered[0]['bad_step'] * 1e3:.0f} ms on rank 0 "
              f"vs {bad['healthy_step'] * 1e3:.0f} ms healthy")
    # the DDP copies (and the watches' cycles around them) go before the process group does: a reducer
    # freed after destroy_process_group can abort or hang the rank at exit
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
