"""What the stall heartbeat and the slow-steps check add to a watched step.

Three measurements, in one process:

1. Interleaved step times: the same Llama-shaped model trains on CPU with AdamW under three watches, each
   with its own copy of model and optimizer, one step each per round in a rotating order, so drift on a
   shared machine hits all alike:
   - ``no step clock``: the watch with the step clock taken out (the watch as it was before this feature),
   - ``after_s=None``: the step clock (slow-steps) without the heartbeat thread,
   - ``heartbeat``: the default (the step clock and the heartbeat thread, after_s=120).
   Reported: each variant's median step (wall clock and this thread's CPU time) and the median per-round
   ratio against ``no step clock``, with its quartiles. Two sizes: a tiny Llama (where a fixed per-step
   cost shows most) and a 4-layer hidden-256 one.
2. The step clock's own host time, timed directly: ``update`` (once per optimizer step) and ``forward``
   (once per forward), per call.
3. The heartbeat thread's own time per wake-up (``Heartbeat.check`` on an armed clock inside its bound);
   it wakes at most once a second.

    OMP_NUM_THREADS=1 python benchmarks/stall_watch.py --rounds 200
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import nbguard  # noqa: E402
from nbguard.watcher.components.stall import Heartbeat, StepClock  # noqa: E402
from nbguard.watcher.core.pipeline import StepView  # noqa: E402

VARIANTS = ("no step clock", "after_s=None", "heartbeat")


def build_model(hidden: int, layers: int, vocab: int, seq_len: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=seq_len)
    return LlamaForCausalLM(config)


def without_step_clock(model, optimizer):
    """The watch as it was before the step clock: a watch whose components do not include it (the stall
    component's factory returns None while this watch is made)."""
    import dataclasses

    from nbguard.watcher.core import registry

    spec = registry.registered_components()["stall"]
    registry._COMPONENTS["stall"] = dataclasses.replace(spec, make=lambda setup: None)
    try:
        return nbguard.watch(model, optimizer=optimizer, verify=False, log_to=None)
    finally:
        registry._COMPONENTS["stall"] = spec


class Variant:
    def __init__(self, name: str, model):
        self.name, self.model = name, model
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        stall = None if name != "heartbeat" else 120.0
        if name == "no step clock":
            self.watch = without_step_clock(model, self.opt)
        else:
            self.watch = nbguard.watch(model, optimizer=self.opt, verify=False, log_to=None,
                                       config=nbguard.WatchConfig(stall={"after_s": stall}))
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def step(self, batch) -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.thread_time()
        self.model(**batch).loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return time.perf_counter() - wall, time.thread_time() - cpu


def interleaved(model, batches, rounds: int, warmup: int):
    variants = [Variant(name, model if i == 0 else copy.deepcopy(model)) for i, name in enumerate(VARIANTS)]
    for v in variants:
        for w in range(warmup):
            v.step(batches[w % len(batches)])
    ratios: dict[str, list[float]] = {f"{name} ({clock})": [] for name in VARIANTS[1:] for clock in ("wall", "CPU")}
    for r in range(rounds):
        this_round: dict[str, tuple[float, float]] = {}
        order = variants[r % 3:] + variants[:r % 3]
        for v in order:
            wall, cpu = v.step(batches[r % len(batches)])
            v.wall.append(wall)
            v.cpu.append(cpu)
            this_round[v.name] = (wall, cpu)
        base = this_round["no step clock"]
        for name in VARIANTS[1:]:
            ratios[f"{name} (wall)"].append(this_round[name][0] / base[0])
            ratios[f"{name} (CPU)"].append(this_round[name][1] / base[1])
    for v in variants:
        assert v.watch.events == [], v.watch.summary()  # a healthy run raises nothing, stall or slow-steps
        v.watch.detach()
    return variants, ratios


def host_cost(repeats: int = 100_000) -> dict[str, float]:
    clock = StepClock(120.0)
    view = StepView(0, ("a",), (1.0,), 1.0, None, False)
    clock.update(view)
    start = time.perf_counter()
    for _ in range(repeats):
        clock.update(view)
    update = (time.perf_counter() - start) / repeats * 1e6
    start = time.perf_counter()
    for _ in range(repeats):
        clock.forward()
    forward = (time.perf_counter() - start) / repeats * 1e6

    class Watched:  # what the heartbeat holds a weak reference to
        step = 0

        def emit(self, event):
            raise AssertionError("no stall inside the bound")

    watched = Watched()
    heartbeat = Heartbeat(clock, watched)  # not started: check() timed on this thread
    start = time.perf_counter()
    for _ in range(repeats // 10):
        heartbeat.check()
    check = (time.perf_counter() - start) / (repeats // 10) * 1e6
    return {"StepClock.update, per optimizer step": update, "StepClock.forward, per forward": forward,
            "Heartbeat.check, per wake-up (at most 1/s)": check}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for label, hidden, layers, vocab, seq_len, batch_size, rounds in (
            ("tiny Llama (hidden 64, 2 layers), batch 4x16", 64, 2, 256, 16, 4, args.rounds),
            ("Llama hidden 256, 4 layers, batch 4x128", 256, 4, 2048, 128, 4, max(20, args.rounds // 5))):
        model = build_model(hidden, layers, vocab, seq_len)
        gen = torch.Generator().manual_seed(0)
        batches = []
        for _ in range(4):
            ids = torch.randint(1, vocab, (batch_size, seq_len), generator=gen)
            batches.append({"input_ids": ids, "labels": ids.clone()})
        variants, ratios = interleaved(model, batches, rounds, args.warmup)
        n_params = sum(p.numel() for p in model.parameters())
        print(f"{label}: {n_params / 1e6:.2f}M parameters, {rounds} rounds")
        for v in variants:
            print(f"  {v.name:<20} median step {statistics.median(v.wall) * 1e3:8.2f} ms wall, "
                  f"{statistics.median(v.cpu) * 1e3:8.2f} ms CPU")
        for name, values in ratios.items():
            q = statistics.quantiles(values, n=4)
            print(f"  ratio {name} / no step clock, per round: median {statistics.median(values):.4f} "
                  f"(quartiles {q[0]:.4f}-{q[2]:.4f})")
    for name, micros in host_cost().items():
        print(f"  {name}: {micros:.2f} us")


if __name__ == "__main__":
    main()
