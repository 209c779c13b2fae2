"""The quickstart and the GradScaler notebooks, executed headless, and notebooks/run.py itself (the other
notebooks: tests/test_notebooks_*.py, split so both workers run notebooks; notebook_run_helpers.py says why)."""
from __future__ import annotations

import math

import pytest
from notebook_run_helpers import (  # noqa: F401  (execute: the fixture)
    NOTEBOOKS,
    _cells,
    _docs,
    _events,
    _no_errors,
    _not_in_tf450_lane,
    _origins,
    _rules,
    _runner,
    _text,
    execute,
)

pytestmark = pytest.mark.notebooks


def test_quickstart(execute):
    """The story: healthy steps, the turn at the step the rare-token rows arrive, localised, the
    verified fix applied from its card's code path, the same run healthy."""
    _not_in_tf450_lane()
    nb, out = execute("00_quickstart.ipynb")
    _no_errors(nb)
    assert "fp16-overflow-risk" in _rules(_docs(nb, "before-fix", "audit"))
    (failing,) = _docs(nb, "before-fix", "watch")
    events = _events([failing])
    assert [e["kind"] for e in events][:1] == ["nonfinite-loss"]
    assert events[0]["step"] == 2 and events[0]["cause"] == "overflow"
    assert _origins(events)[0] == "model.layers.0.self_attn.q_proj"
    losses = failing["history"]["loss"]
    assert all(math.isfinite(float(x)) for x in losses[:2]) and not any(math.isfinite(float(x)) for x in losses[2:])
    assert "switch-precision (to=fp32) verified on the failing step" in _text(nb, "fix")  # the T4 variant ran
    assert "fp16-overflow-risk" not in _rules(_docs(nb, "after-fix", "audit"))
    (healthy,) = _docs(nb, "after-fix", "watch")
    assert _events([healthy]) == [] and len(healthy["history"]["loss"]) == len(losses)
    assert all(math.isfinite(float(x)) for x in healthy["history"]["loss"])  # the codec spells NaN "nan"
    heatmaps = _cells(nb, "heatmaps")[0].outputs[0]["data"]["text/html"]
    assert heatmaps.count("data:image/png;base64,") == 2
    assert (out / "00_quickstart.html").is_file()
    report = (out / "00_quickstart.html").read_text()
    assert "model.layers.0.self_attn.q_proj" in report and "switch-precision" in report


def test_gradscaler_frozen_eval_loss(execute):
    _not_in_tf450_lane()
    nb, out = execute("03_gradscaler_frozen_eval_loss.ipynb")
    events = _events(_docs(nb, "before-fix", "watch"))
    kinds = [e["kind"] for e in events]
    assert "skipped-steps" in kinds and "frozen-params" in kinds
    streak = next(e for e in events if e["kind"] == "skipped-steps")
    assert streak["evidence"]["loss_scale"] < 65536.0
    assert "model.layers.1.mlp" in _origins([streak])
    assert _events(_docs(nb, "after-fix", "watch")) == []
    rows = [line for line in _text(nb, "after-fix", "watch").splitlines() if "'eval_loss'" in line]
    eval_losses = [float(r.split("'eval_loss': ")[1].split(",")[0]) for r in rows]
    assert len(set(eval_losses)) == len(eval_losses) == 3     # the eval loss moves after the fix
    assert (out / "03_gradscaler_frozen_eval_loss.html").is_file()


def test_committed_notebooks_have_no_outputs():
    import nbformat

    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
        assert nb.metadata["kernelspec"]["name"] == "python3", path.name
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, f"{path.name}: strip outputs before committing"


def test_runner_reports_a_failing_notebook(tmp_path):
    """run.py exits non-zero on a failing cell, keeps the executed copy, and gives the kernel NBGUARD_OUT."""
    import sys

    import nbformat
    from nbformat.v4 import new_code_cell, new_notebook

    nb = new_notebook(cells=[
        new_code_cell("import os, sys\nprint(os.environ['NBGUARD_OUT'])\nprint(sys.executable)"),
        new_code_cell("raise ValueError('planted failure')"),
    ])
    source = tmp_path / "failing.ipynb"
    nbformat.write(nb, source)
    out = tmp_path / "out"
    assert _runner().main(["--out", str(out), str(source)]) == 1
    executed = nbformat.read(out / "failing.ipynb", as_version=4)
    printed = executed.cells[0].outputs[0]["text"].split()
    assert printed == [str(out.resolve()), sys.executable]       # this interpreter's kernel, not a global one
    assert executed.cells[1].outputs[0]["ename"] == "ValueError"


def test_runner_names_the_cells_whose_fix_cell_was_printed_not_inserted(tmp_path, capsys):
    """Headless nothing can insert a cell: the kernel prints it, and run.py says which cell holds it."""
    import nbformat
    from nbformat.v4 import new_code_cell, new_notebook

    nb = new_notebook(cells=[
        new_code_cell("print('setup')"),
        new_code_cell("from nbguard.notebook.frontend import put_next_cell\nput_next_cell('model = model.float()')"),
    ])
    source = tmp_path / "fix.ipynb"
    nbformat.write(nb, source)
    assert _runner().main(["--out", str(tmp_path / "out"), str(source)]) == 0
    printed = capsys.readouterr().out
    assert "cell 2: a fix cell was not inserted (no front end runs here)" in printed
    assert "cell 1:" not in printed
    executed = nbformat.read(tmp_path / "out" / "fix.ipynb", as_version=4)
    assert "model = model.float()" in executed.cells[1].outputs[0]["text"]
