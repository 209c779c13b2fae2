"""Write the Lab extension's test fixtures from real nbguard runs of planted faults.

Each fixture is the ``application/vnd.nbguard.v1+json`` entry of the MIME bundle a real result
displays (document + ``view``), built by ``tests/view_helpers.py`` (the same results the Python
view tests check), so the TypeScript renderer is tested against the contract the kernel sends,
never against a hand-written imitation of it. From the repository root:

    PYTHONPATH=$PWD python labextension/scripts/make_fixtures.py [OUT_DIR]

``make test-labextension`` runs it before vitest. Tiny models only: well under a minute.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))  # the planted-fault helpers the Python tests use

from view_helpers import real_payloads  # noqa: E402

from nbguard.document.codec import decode_float  # noqa: E402
from nbguard.document.view import fmt_num  # noqa: E402

DEFAULT_OUT = ROOT / "labextension" / "test" / "fixtures"
# Magnitudes on both sides of "%.4g"'s switches to scientific notation, beside the real values.
EDGES = [0.0, -0.0, 1e-5, 0.0001234567, 0.5, 123456.0, 1.5e5, -2.25e-7, 65504.0, 1e15, 1e16, 3.14159e20]


def spellings(payloads: dict[str, dict]) -> list[list]:
    """[encoded number, how view.py spells it] for every number in the real watch's grids and
    series (and a few edge magnitudes): the heatmap hover text must spell numbers the same way."""
    watch = payloads["watch"]
    values = [v for row in watch["history"]["grad_norm"] + watch["activations"]["absmax"] for v in row]
    values += watch["history"]["loss"] + watch["history"]["total_grad_norm"] + EDGES
    unique = list(dict.fromkeys(v for v in values if v is not None))
    return [[v, fmt_num(decode_float(v))] for v in unique]


def main(argv: list[str]) -> int:
    out = Path(argv[1]) if len(argv) > 1 else DEFAULT_OUT
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.json"):
        stale.unlink()  # a fixture whose builder is gone must not linger
    for name, data in real_payloads().items():
        (out / f"{name}.json").write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        print(f"{name}.json: {len(data['view']['sections'])} view sections")
    numbers = spellings(real_payloads())
    (out / "numbers.json").write_text(json.dumps(numbers) + "\n", encoding="utf-8")
    print(f"numbers.json: {len(numbers)} spellings")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
