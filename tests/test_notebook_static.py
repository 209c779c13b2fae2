"""A notebook executed by nbclient in a real kernel: the saved outputs and nbconvert's HTML still show
nbguard's results without a kernel (text/plain + static text/html + the nbguard JSON in ONE output).

nbclient is headless (no one at a front end): no widget view rides in the outputs, since its saved state
would win over the static HTML in ``nbconvert --to html`` and draw an empty box there; and a cell nbguard
would insert is printed instead, saying it was not inserted."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = Path(__file__).resolve().parents[1]
MIME = "application/vnd.nbguard.v1+json"
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"

CELLS = [
    "%load_ext nbguard",
    "import torch\nfrom nbguard.testing import tiny_llama, tiny_batch\nmodel = tiny_llama(dtype=torch.float16)",
    "%precision_check --hardware t4",
    "loss = torch.randn(2, 3).sum()\nloss.backward()",
    "model = model.float()\nopt = torch.optim.SGD(model.parameters(), lr=0.01)\nbatch = tiny_batch()",
    "%%nanwatch model\nfor _ in range(2):\n    opt.zero_grad()\n    model(**batch).loss.backward()\n    opt.step()",
    "from nbguard.notebook.frontend import put_next_cell\ninserted = put_next_cell('model = model.float()  # the fix')\n"
    "print('inserted:', inserted)",
    "%nbguard fix upcast-trainable-fp32",
]


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    tmp = tmp_path_factory.mktemp("nb")
    spec = tmp / "kernels" / "nbguard-test"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "nbguard test", "language": "python",
        "env": {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}}))
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS])
    km = KernelManager(kernel_name="nbguard-test", kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(tmp / "kernels")]))
    # store_widget_state as `jupyter nbconvert --execute` and notebooks/run.py run it
    client = nbclient.NotebookClient(nb, km=km, timeout=300, allow_errors=True, store_widget_state=True,
                                     resources={"metadata": {"path": str(ROOT)}})
    client.execute()
    path = tmp / "executed.ipynb"
    nbformat.write(nb, path)
    return nbformat.read(path, as_version=4)  # what a saved notebook holds


def _nbguard_outputs(cell):
    return [o for o in cell.outputs if o.get("output_type") in ("display_data", "execute_result") and MIME in o.get("data", {})]


def test_every_nbguard_output_is_one_bundle_with_static_fallbacks(executed):
    outputs = [o for cell in executed.cells for o in _nbguard_outputs(cell)]
    assert len(outputs) >= 3
    for output in outputs:
        data = output["data"]
        assert {"text/plain", "text/html", MIME} <= set(data) and WIDGET_MIME not in data
        assert data[MIME]["schema_version"] == 1 and data[MIME]["output_id"]
        assert "pip install ipywidgets" not in data["text/plain"]  # headless: nothing is missing to install


def test_audit_error_and_watch_outputs_survive_the_kernel(executed):
    audit, error_cell, watch = executed.cells[2], executed.cells[3], executed.cells[5]
    [out] = _nbguard_outputs(audit)
    assert "trainable-low-precision" in out["data"]["text/html"]
    kinds = [o["output_type"] for o in error_cell.outputs]
    assert kinds.index("error") < kinds.index("display_data")  # traceback first, then the diagnosis
    [diag] = _nbguard_outputs(error_cell)
    assert diag["data"][MIME]["diagnoses"][0]["signature"] == "no-grad-input"
    [live] = _nbguard_outputs(watch)  # updated in place at the end of the cell: the final history
    assert live["data"][MIME]["history"]["steps"] == [0, 1]


def _visible_text(html_page: str) -> str:
    """What a browser without JavaScript shows: no scripts (the saved widget state lives in one), no tags."""
    html_page = re.sub(r"<(script|style)\b.*?</\1>", " ", html_page, flags=re.S | re.I)
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html_page))


def test_nbconvert_html_shows_the_static_view(executed):
    from nbconvert import HTMLExporter

    body, _ = HTMLExporter().from_notebook_node(executed)
    shown = _visible_text(body)
    assert "nbguard precision audit" in shown and "trainable-low-precision" in shown  # the audit's cards
    assert "no-grad-input" in shown
    assert "nbguard NaN/Inf watch" in shown and "steps 0–1" in shown  # the watch's summary
    assert "jupyter-widgets" not in body


def test_headless_cell_to_insert_is_printed_and_says_it_was_not_inserted(executed):
    text = "".join(o.get("text", "") for o in executed.cells[6].outputs if o.get("output_type") == "stream")
    assert "no front end is connected" in text and "was not inserted" in text
    assert "model = model.float()  # the fix" in text and "inserted: False" in text


def test_headless_nbguard_fix_prints_the_cell_it_could_not_insert(executed):
    """The magic itself, not only the helper: `%nbguard fix` run by nbclient said nothing and inserted nothing."""
    text = "".join(o.get("text", "") for o in executed.cells[7].outputs if o.get("output_type") == "stream")
    assert "was not inserted" in text
    assert "float32" in text.split("was not inserted", 1)[1]  # the cell's code follows the line


def test_a_shell_with_a_front_end_gets_the_cell_as_its_next_input():
    from IPython.core.interactiveshell import InteractiveShell

    from nbguard.notebook.frontend import put_next_cell

    ip = InteractiveShell.instance()
    ip.rl_next_input = None
    assert put_next_cell("x = 1", ip) is True  # no kernel: a terminal IPython fills its next prompt
    assert ip.rl_next_input == "x = 1"
    ip.rl_next_input = None
