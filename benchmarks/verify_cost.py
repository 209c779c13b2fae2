"""The cost of verified fixes: automatic verification against one training step, and the memory it adds.

A Llama-shaped model (hidden 512, 4 layers, vocab 8192 by default) trains under fp16 autocast with
``model.layers.2.mlp.up_proj`` scaled so its output reaches 2e5 (it overflows fp16, fits bf16). The
watch localises the first step and verifies its fixes automatically (bounded); the same step is then
verified by hand with every candidate. Each round uses fresh copies of the model and optimizer.

    OMP_NUM_THREADS=1 python benchmarks/verify_cost.py --rounds 5

Reported: the median training step (fwd + bwd + SGD step, no watch), the median automatic
verification (``watch.verification.seconds``) and manual ``nbguard.verify(event)``, as step
multiples; the memory estimate and what the budget decided; on CUDA, the measured peak added.
"""
from __future__ import annotations

import argparse
import copy
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import nbguard  # noqa: E402
from nbguard.verifier.memory import estimate_step_bytes, gb  # noqa: E402


def build(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
                         num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=8,
                         max_position_embeddings=args.seq_len, attn_implementation="sdpa")
    model = LlamaForCausalLM(config).to(args.device)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, args.vocab, (args.batch_size, args.seq_len), generator=gen).to(args.device)
    batch = {"input_ids": ids, "labels": ids.clone()}
    up = model.model.layers[2].mlp.up_proj
    seen = []
    handle = up.register_forward_hook(lambda m, a, out: seen.append(out.detach().abs().max().item()))
    with torch.no_grad():
        model(**batch)
    handle.remove()
    with torch.no_grad():
        up.weight.mul_(2e5 / seen[0])
    return model, batch


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def step(model, opt, batch, device):
    with torch.autocast(device.split(":")[0], dtype=torch.float16):
        loss = model(**batch).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def peak_rss_once(args, verify: bool) -> None:
    """One watched failing step in this process; prints the process' peak RSS in bytes."""
    model, batch = build(args)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    with nbguard.watch(model, optimizer=opt, policy="skip", verify=verify) as watch:
        step(model, opt, batch, args.device)
    assert (watch.verification is not None) == verify
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def rss_added(argv: list[str]) -> tuple[int, int]:
    """Peak RSS of a watched failing step without and with automatic verification (fresh processes)."""
    peaks = []
    for flag in ("--rss-off", "--rss-on"):
        out = subprocess.run([sys.executable, __file__, *argv, flag], capture_output=True, text=True, check=True)
        peaks.append(int(out.stdout.strip().splitlines()[-1]))
    return peaks[0], peaks[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rss", action="store_true", help="also measure the peak RSS added (CPU; two fresh processes)")
    parser.add_argument("--rss-off", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rss-on", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.rss_off or args.rss_on:
        peak_rss_once(args, verify=args.rss_on)
        return
    base, batch = build(args)
    steps, autos, manuals, runs, peaks = [], [], [], [], []
    last = None
    for _ in range(args.rounds):
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        step(model, opt, batch, args.device)  # warm-up
        sync(args.device)
        started = time.perf_counter()
        step(model, opt, batch, args.device)
        sync(args.device)
        steps.append(time.perf_counter() - started)

        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        if args.device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.max_memory_allocated()
        with nbguard.watch(model, optimizer=opt, policy="skip") as watch:
            step(model, opt, batch, args.device)
        if args.device.startswith("cuda"):
            peaks.append(torch.cuda.max_memory_allocated() - before)
        last = watch.verification
        autos.append(last.seconds)
        runs.append(sum(v.step is not None for v in last.verdicts))
        started = time.perf_counter()
        nbguard.verify(watch.events[0])
        manuals.append(time.perf_counter() - started)
    step_s = statistics.median(steps)
    print(f"model: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, batch {args.batch_size} x "
          f"{args.seq_len}, {sum(p.numel() for p in base.parameters()) / 1e6:.1f}M parameters, {args.device}")
    print(f"training step (median of {args.rounds}): {step_s * 1e3:.0f} ms")
    print(f"automatic verification: {statistics.median(autos) * 1e3:.0f} ms = "
          f"{statistics.median(autos) / step_s:.2f} step times ({max(runs)} step-level runs + module level)")
    print(f"manual nbguard.verify(event), every candidate + baseline: {statistics.median(manuals) * 1e3:.0f} ms = "
          f"{statistics.median(manuals) / step_s:.2f} step times")
    print("verdicts:", ", ".join(f"{v.fix}={v.verdict}" for v in last.verdicts))
    print("module level:", last.module_check.summary if last.module_check else "-")
    estimate = estimate_step_bytes(base, [type("MB", (), {"args": (), "kwargs": batch})()], {})
    print("memory estimate of a shadow step:", {k: gb(v) for k, v in estimate.items()},
          "budget:", gb(last.memory.get("budget")))
    if peaks:
        print(f"measured peak added by the watched step with verification: {gb(statistics.median(peaks))}")
    if args.rss:
        shape = ["--hidden", args.hidden, "--layers", args.layers, "--vocab", args.vocab, "--batch-size",
                 args.batch_size, "--seq-len", args.seq_len, "--device", args.device, "--threads", args.threads]
        off, on = rss_added([str(a) for a in shape])
        print(f"peak RSS of the watched failing step: {gb(off)} without verification, {gb(on)} with "
              f"(+{gb(on - off)})")


if __name__ == "__main__":
    main()
