"""What the divergence / dead-run checks (and, on TRL trainers, the reward and preference checks) add
to a watched step.

Two measurements:

1. Interleaved step times: a Llama-shaped model trains on CPU with AdamW under two watches, one with
   the run checks and one without (each variant its own copy of the model and optimizer; one step
   each per round, the order rotating), so drift on a shared machine hits both alike. Reported: the
   median per-round ratio (with / without) and its spread.
2. The checks' own host time per step, timed directly on the values a real watched step read (the
   per-group gradient norms of a 32-layer model's 200 groups and the loss): this is all they add,
   since they read nothing from the device.

    OMP_NUM_THREADS=1 python benchmarks/detectors_cost.py --rounds 40
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
from nbguard.watcher.detectors.divergence import RunHealth  # noqa: E402
from nbguard.watcher.detectors.rl import CollapseChecks, PreferenceChecks, RewardChecks  # noqa: E402
from nbguard.watcher.integrations.trl import RewardCall  # noqa: E402


def build_model(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
                         num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=8,
                         max_position_embeddings=args.seq_len)
    return LlamaForCausalLM(config)


def make_batch(args, seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, args.vocab, (args.batch_size, args.seq_len), generator=gen)
    return {"input_ids": ids, "labels": ids.clone()}


class Variant:
    def __init__(self, name, model, with_checks: bool):
        self.name, self.model = name, model
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        self.watch = nbguard.watch(model, optimizer=self.opt, verify=False,
                                   config=nbguard.WatchConfig(run_checks={"enabled": with_checks}))
        self.times: list[float] = []

    def step(self, batch) -> float:
        start = time.thread_time()  # this thread's CPU time: time spent descheduled does not count
        self.model(**batch).loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return time.thread_time() - start


def interleaved(args):
    base = build_model(args)
    variants = [Variant("watch", base, False), Variant("watch + run checks", copy.deepcopy(base), True)]
    batches = [make_batch(args, s) for s in range(4)]
    for v in variants:
        for w in range(args.warmup):
            v.step(batches[w % len(batches)])
    ratios = []
    for r in range(args.rounds):
        this_round = {}
        for v in (variants if r % 2 == 0 else variants[::-1]):
            this_round[v.name] = v.step(batches[r % len(batches)])
            v.times.append(this_round[v.name])
        ratios.append(this_round["watch + run checks"] / this_round["watch"])
    for v in variants:
        assert v.watch.events == [], v.watch.summary()  # a healthy run raises nothing
        v.watch.detach()
    return sum(p.numel() for p in base.parameters()), variants, ratios


def host_cost(repeats: int = 2000):
    """Microseconds per call of each check, on values shaped like a 32-layer model's step."""
    groups = {f"model.layers.{i}.{part}": 0.1 + 0.01 * (i % 7) for i in range(32)
              for part in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm", "x", "y")}
    names, norms = tuple(groups), tuple(groups.values())
    health = RunHealth()
    start = time.perf_counter()
    for step in range(repeats):
        health.update(step, 2.0 - step * 1e-4, names, norms)
    run = (time.perf_counter() - start) / repeats * 1e6
    rewards = RewardChecks(group_size=8, max_completion_length=256, eos_token_id=2)
    call = RewardCall("reward", [float(i % 3) for i in range(64)], ["x"] * 64, [[5] * 100 + [2]] * 64)
    start = time.perf_counter()
    for step in range(repeats):
        rewards.observe(call, step)
    reward = (time.perf_counter() - start) / repeats * 1e6
    prefs = PreferenceChecks()
    logs = {"loss": 0.6, "rewards/margins": 0.1, "rewards/chosen": 0.2, "rewards/rejected": 0.1}
    start = time.perf_counter()
    for step in range(repeats):
        prefs.on_log(step, logs)
    pref = (time.perf_counter() - start) / repeats * 1e6
    collapse = CollapseChecks(None)
    grpo = {"entropy": 2.0, "completions/mean_length": 180.0, "reward": 0.5, "reward_std": 0.3, "kl": 0.01}
    start = time.perf_counter()
    for step in range(repeats):
        collapse.on_log(step, grpo)
    rl_log = (time.perf_counter() - start) / repeats * 1e6
    return {"divergence + dead run, per optimizer step (192 groups)": run,
            "reward checks, per reward-function call (64 completions)": reward,
            "preference checks, per log": pref,
            "GRPO collapse check, per log": rl_log}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    n_params, variants, ratios = interleaved(args)
    q = statistics.quantiles(ratios, n=4)
    print(f"model: {n_params / 1e6:.1f}M parameters, batch {args.batch_size}x{args.seq_len}, {args.rounds} rounds")
    for v in variants:
        print(f"  {v.name:<20} median step {statistics.median(v.times) * 1e3:7.1f} ms (CPU time)")
    print(f"  ratio with/without run checks: median {statistics.median(ratios):.4f} (quartiles {q[0]:.4f}-{q[2]:.4f})")
    step_us = statistics.median(variants[0].times) * 1e6
    for name, micros in host_cost().items():
        print(f"  {name}: {micros:.1f} us ({micros / step_us:.3%} of the step)")


if __name__ == "__main__":
    main()
