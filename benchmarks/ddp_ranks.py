"""Many ranks: the watch's one exchange per step against the ranks' step, and the notebook's view of
them, at 2, 4 and 8 CPU ranks (gloo).

For each world size:
1. ``torchrun`` runs this file as a worker on every rank: the exchange alone (``RankSync.exchange``,
   one ``all_reduce`` of 3 x world-size float32 flags, a barrier before each, so the time is the
   collective's and not the wait for a late peer), then a DDP tiny Llama unwatched and watched,
   interleaved one step each per round (``ddp_overhead.interleaved``).
2. ``notebook_launcher`` forks the ranks from this process, as ``%%nanwatch`` does in a notebook:
   each rank runs a fast watched loop; here the kernel's view (``RankWatches``) with a live
   dashboard counts the messages it received per second, the steps per rank, the dashboard's draws,
   its rows and the report's watches.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/ddp_ranks.py --ranks 2 4 8

The machine has 2 cores: at 4 and 8 ranks the ranks share them, so step times grow with the world
size by the oversubscription; the exchange's own time and the ratios are what carry over.
"""
from __future__ import annotations

import argparse
import copy
import gc
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

from ddp_overhead import build_model, interleaved, run_arguments  # noqa: E402

import nbguard  # noqa: E402


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3


# ---- 1. on every rank, under torchrun ------------------------------------------------------------
def worker(args: argparse.Namespace) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from nbguard.watcher.distributed.ranks import RankSync

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    sync = RankSync(n_groups=args.layers + 2, sharded=False)
    norms, loss = torch.zeros(sync.n_groups), torch.tensor(1.0)
    exchange = []
    for _ in range(args.exchanges):
        dist.barrier()
        start = time.perf_counter()
        sync.exchange(norms, loss)
        exchange.append(time.perf_counter() - start)
    barrier = []
    for _ in range(args.exchanges):  # the floor: a collective that carries nothing
        dist.barrier()
        start = time.perf_counter()
        dist.barrier()
        barrier.append(time.perf_counter() - start)

    base = build_model(args)
    variants = {}
    for name in ("baseline", "watched"):
        model = DDP(base if name == "baseline" else copy.deepcopy(base))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        variants[name] = (model, opt, nbguard.watch(model, optimizer=opt) if name == "watched" else None)
    times, ratios = interleaved(variants, args, rank)
    watch = variants["watched"][2]
    assert watch.events == [], watch.summary()  # a healthy run raises no alarm
    watch.detach()
    if rank == 0:
        print(f"RESULT world={world} bytes={4 * sync.size} exchange_ms={_median_ms(exchange):.3f} "
              f"barrier_ms={_median_ms(barrier):.3f} step_ms={_median_ms(times['baseline']):.1f} "
              f"watched_ms={_median_ms(times['watched']):.1f} "
              f"ratio={statistics.median(ratios['watched']):.3f}", flush=True)
    del variants, watch
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def run_workers(world: int, args: argparse.Namespace) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}", "--master_addr=127.0.0.1",
           f"--master_port={_free_port()}", __file__, "--worker", "--rounds", str(args.rounds),
           "--exchanges", str(args.exchanges), "--hidden", str(args.hidden), "--layers", str(args.layers),
           "--vocab", str(args.vocab), "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT")), None)
    if done.returncode != 0 or line is None:
        raise SystemExit(f"{world} ranks failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return line


# ---- 2. the notebook's view of forked ranks --------------------------------------------------------
def fast_rank_loop(steps: int, hidden: int, vocab: int) -> None:
    """What a user's training function under ``notebook_launcher`` does: DDP, a watch, a fast loop."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from nbguard.testing import tiny_batch, tiny_llama

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model = DDP(tiny_llama(hidden_size=hidden, vocab_size=vocab))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    nbguard.watch(model, optimizer=opt)
    batch = tiny_batch(vocab_size=vocab, seed=dist.get_rank())
    for _ in range(steps):
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    dist.barrier()
    dist.destroy_process_group()  # the watch is not detached: the rank's exit sends its last steps


def kernel_view(world: int, args: argparse.Namespace) -> dict:
    from accelerate import notebook_launcher

    from nbguard.document.merge import gather
    from nbguard.notebook.ranks import RankWatches
    from nbguard.notebook.widgets.dashboard import WatchDashboard

    view = RankWatches(record=False).open()
    dashboard = WatchDashboard(view).attach()
    start = time.perf_counter()
    notebook_launcher(fast_rank_loop, args=(args.view_steps, 32, 128), num_processes=world,
                      use_port=str(_free_port()))
    wall = time.perf_counter() - start
    view.detach()
    dashboard.finish()
    rows = view.rank_rows()
    steps = sorted(len(view.ranks[r].history) for r in view.ranks)
    return {"wall_s": wall, "messages": view.channel.received, "per_s": view.channel.received / wall,
            "steps_sent": world * args.view_steps, "steps_min": steps[0], "rows": len(rows),
            "report_watches": len(gather(view.to_document(), "watches")), "draws": dict(dashboard.renders),
            "errors": view.channel.errors + dashboard.errors}


def main() -> None:
    parser = run_arguments(__doc__.split("\n\n")[0], rounds=30)
    parser.set_defaults(hidden=64, layers=2, vocab=256, seq_len=32, batch_size=2)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--exchanges", type=int, default=200)
    parser.add_argument("--view-steps", type=int, default=300)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    print(f"tiny Llama hidden {args.hidden}, {args.layers} layers, batch {args.batch_size} x {args.seq_len} per rank, "
          f"{args.rounds} rounds; {args.exchanges} exchanges timed; {args.view_steps} steps per rank for the view")
    print("| ranks | exchange bytes | exchange (median) | empty barrier | step, no watch | ratio watched/unwatched |"
          " view: messages/s | steps received | rows / report watches | dashboard draws |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for world in args.ranks:
        fields = dict(kv.split("=") for kv in run_workers(world, args).split()[1:])
        view = kernel_view(world, args)
        assert not view["errors"], view["errors"]
        print(f"| {world} | {fields['bytes']} | {fields['exchange_ms']} ms | {fields['barrier_ms']} ms | "
              f"{fields['step_ms']} ms | {fields['ratio']}x | {view['per_s']:.1f} ({view['messages']} in "
              f"{view['wall_s']:.1f} s) | {view['steps_min'] * world}/{view['steps_sent']} | "
              f"{view['rows']} / {view['report_watches']} | {view['draws']['light']} light, "
              f"{view['draws']['heavy']} heavy |", flush=True)


if __name__ == "__main__":
    main()
