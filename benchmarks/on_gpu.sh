#!/usr/bin/env bash
# What only a GPU shows, in one run (a lent GPU machine's time is short): the CUDA tests, then the
# watch's fixed cost on the GPU with kernel and host-wait counts, without and with a loss.item() per
# step, then issue 45's figures: read="deferred" (fused AdamW, skip on the device) against the host read,
# on the fixed-cost models and the 21M Llama. Run from the repository root: bash benchmarks/on_gpu.sh [results-dir]
set -uo pipefail
results="${1:-${OUT:-gpu-results}}"
mkdir -p "$results"
python="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$results/device.txt"
"$python" -c "import sys, torch, transformers, peft, accelerate; print('python', sys.version.split()[0], '| torch', torch.__version__, '| transformers', transformers.__version__, '| peft', peft.__version__, '| accelerate', accelerate.__version__)" | tee -a "$results/device.txt"
"$python" -m pytest -q -m cuda tests/test_cuda.py tests/test_watch_scaler.py -p no:cacheprovider --durations=5 2>&1 | tee "$results/cuda_tests.log"
rounds="${ROUNDS:-20}"
for extra in "" "--loss-item"; do
  "$python" benchmarks/overhead.py --fixed-cost --device cuda --rounds "$rounds" --launches $extra \
    2>>"$results/overhead.err" | tee -a "$results/fixed_cost.md"
done
# issue 45: every variant on fused AdamW; "host waits" must read 0.0 for the step-late read
"$python" benchmarks/overhead.py --fixed-cost --device cuda --rounds "$rounds" --launches --fused --read-deferred \
  2>>"$results/overhead.err" | tee -a "$results/read_deferred.md"
"$python" benchmarks/overhead.py --watch-only --skip-activations --skip-localise --device cuda --rounds 40 --fused \
  --read-deferred 2>>"$results/overhead.err" | tee -a "$results/read_deferred.md"
