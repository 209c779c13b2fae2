"""Running Liger in a child process: applying Liger to a model also rebinds transformers' module-level
classes and functions (``modeling_llama.LlamaRMSNorm = LigerRMSNorm``, ...), which would leak into every
later test of the worker, and Triton's interpreter is chosen when a kernel is defined, so
``TRITON_INTERPRET`` must be in the environment before triton is imported."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MARK = "LIGER-RESULT "


def needs_liger() -> None:
    pytest.importorskip("liger_kernel")
    pytest.importorskip("triton")


def run_child(code: str, interpret: bool = False) -> dict:
    """Run ``code`` in a fresh Python; it prints its result with ``emit(obj)``; the result is returned."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"})
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    prelude = ("import json, warnings\nwarnings.simplefilter('ignore')\n"
               f"def emit(obj):\n    print({MARK!r} + json.dumps(obj, default=str), flush=True)\n")
    done = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], cwd=REPO, capture_output=True,
                          text=True, timeout=600, env=env)
    lines = [line[len(MARK):] for line in done.stdout.splitlines() if line.startswith(MARK)]
    assert done.returncode == 0 and lines, f"child failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return json.loads(lines[-1])
