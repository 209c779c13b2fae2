"""How long the audit takes on a Llama-3-8B-shaped model with LoRA on every linear layer.

The model lives on the meta device (no memory for weights), so this measures the audit's own
work: walking ~2,700 modules and ~1,200 parameters once into the shared context and running every
rule against it. Target: under 1 s.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/audit_scale.py [--runs 7]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing


def build():
    from peft import LoraConfig, get_peft_model

    from nbguard.testing import meta_llama_8b

    model = meta_llama_8b()
    lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return get_peft_model(model, lora)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--hardware", default="a100")
    opts = parser.parse_args()

    from transformers import TrainingArguments

    import nbguard

    t0 = time.perf_counter()
    model = build()
    build_s = time.perf_counter() - t0
    args = TrainingArguments("/tmp/nbguard-bench", bf16=True, use_cpu=True, report_to=[], max_grad_norm=1.0)
    modules = sum(1 for _ in model.modules())
    params = sum(1 for _ in model.parameters())
    trainable = sum(1 for p in model.parameters() if p.requires_grad)

    nbguard.audit(model, args=args, hardware=opts.hardware)  # warm-up: lazy imports, first-call caches
    times = []
    for _ in range(opts.runs):
        t = time.perf_counter()
        result = nbguard.audit(model, args=args, hardware=opts.hardware)
        times.append(time.perf_counter() - t)

    print(f"model: Llama-3-8B shape on meta + LoRA r=16 on all linear layers (built in {build_s:.1f} s)")
    print(f"modules: {modules}  parameters: {params}  trainable: {trainable}")
    print(f"findings: {sorted(result.rules)}")
    print(f"audit runs: {opts.runs}  median: {statistics.median(times):.3f} s  "
          f"min: {min(times):.3f} s  max: {max(times):.3f} s  (target < 1 s)")


if __name__ == "__main__":
    main()
