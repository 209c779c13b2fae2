"""Scheduled notebooks stop at a failed magic: nbclient (what papermill and "Run all" do) in a real kernel.

Uses the repository's own headless runner (notebooks/run.py), which executes with nbclient in a
fresh kernel of this interpreter with this checkout's nbguard.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
pytest.importorskip("nbclient")
from nbformat.v4 import new_code_cell, new_notebook  # noqa: E402

RUNNER = Path(__file__).resolve().parents[1] / "notebooks" / "run.py"
# A plain PyTorch model: the run stopping is under test, not the model, and importing transformers for a
# tiny Llama was about two thirds of each fresh kernel's CPU time.
SETUP = ("%load_ext nbguard\nimport torch\n"
         "model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8)).half()\n"
         "opt = torch.optim.SGD(model.parameters(), lr=0.1)")


def _execute(tmp_path: Path, *cells: str):
    spec = importlib.util.spec_from_file_location("nbguard_notebook_runner", RUNNER)
    runner = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(runner)
    source = tmp_path / "scheduled.ipynb"
    nbformat.write(new_notebook(cells=[new_code_cell(c) for c in cells]), source)
    nb, _seconds, error = runner.execute_notebook(source, tmp_path / "out", timeout=240)
    return nb, error


def _ran(nb) -> list[bool]:
    return [cell.execution_count is not None for cell in nb.cells]


def test_a_magic_given_a_bad_name_stops_the_run(tmp_path):
    nb, error = _execute(tmp_path, SETUP, "%precision_check modle --hardware t4", "trained = True")
    assert error is not None and error.ename == "UsageError" and "no variable named 'modle'" in error.evalue
    printed = "".join(o.get("text", "") for o in nb.cells[1].outputs if o["output_type"] == "stream")
    assert printed.strip() == "UsageError: nbguard: no variable named 'modle' in the notebook"  # one line
    assert _ran(nb) == [True, True, False]  # the training cell never ran on an unaudited model


def test_a_watched_cell_that_raises_stops_the_run_with_its_own_error(tmp_path):
    nb, error = _execute(tmp_path, SETUP, "%%nanwatch model --optimizer opt\ntorch.randn(2).sum().backward()",
                         "after = True")
    assert error is not None
    [failed] = [o for o in nb.cells[1].outputs if o["output_type"] == "error"]
    assert failed["ename"] == "RuntimeError" and "does not require grad" in failed["evalue"]
    kinds = [o["data"]["application/vnd.nbguard.v1+json"]["kind"] for o in nb.cells[1].outputs
             if "application/vnd.nbguard.v1+json" in o.get("data", {})]
    assert kinds == ["watch", "diagnosis"]
    assert _ran(nb) == [True, True, False]


def test_good_magics_run_the_whole_notebook(tmp_path):
    nb, error = _execute(tmp_path, SETUP, "%precision_check model --hardware t4",
                         "%%nanwatch model --optimizer opt\nx = 1", "done = True")
    assert error is None and _ran(nb) == [True, True, True, True]
