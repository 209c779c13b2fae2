"""What the audit's probe costs against a plain forward + backward of the same batch.

The probe hooks every module: forward hooks keep output and input abs-max, and (new in issue 13)
tensor hooks on every module output keep the abs-max of the gradient reaching it in backward; all
values come back in one host read. The baseline is the same model in eval mode doing forward +
backward with no hooks. Rounds alternate the two so a busy shared machine affects both alike.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/probe_cost.py [--rounds 7] [--clock cpu]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="cpu")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    opts = parser.parse_args()

    import torch

    from nbguard.auditor.probe import run_probe
    from nbguard.testing import tiny_batch, tiny_llama

    torch.set_num_threads(1)
    clock = CLOCKS[opts.clock]
    model = tiny_llama(hidden_size=opts.hidden, intermediate_size=4 * opts.hidden, num_hidden_layers=opts.layers,
                       num_attention_heads=8, num_key_value_heads=4, vocab_size=8192)
    batch = tiny_batch(4, opts.seq, vocab_size=8192)

    def plain():
        model.eval()
        model(**batch).loss.backward()
        for p in model.parameters():
            p.grad = None

    def probe():
        run_probe(model, batch)

    plain(), probe()  # warm-up
    times = {"plain fwd+bwd": [], "probe (fwd+bwd, hooks)": []}
    for r in range(opts.rounds):
        order = list(times.items()) if r % 2 == 0 else list(times.items())[::-1]
        for name, bucket in order:
            t = clock()
            (plain if name.startswith("plain") else probe)()
            bucket.append(clock() - t)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    modules = sum(1 for _ in model.modules())
    print(f"model: Llama-shaped, {params:.1f}M parameters, {modules} modules; batch 4 x {opts.seq}; "
          f"clock={opts.clock}; rounds={opts.rounds}")
    base = statistics.median(times["plain fwd+bwd"])
    for name, bucket in times.items():
        med = statistics.median(bucket)
        print(f"{name:24s} median {med * 1e3:8.1f} ms  {med / base:.3f}x")


if __name__ == "__main__":
    main()
