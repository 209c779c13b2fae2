"""The kernel-side widgets in a real JupyterLab 4 with ipywidgets' own lab extension, in Chromium.

"Insert cell" on a finding card goes kernel -> comm -> nbguard's lab extension, which inserts the
fix cell directly below the cell showing the card (not below the active cell) and replies; the
card says so. "Apply" fixes the model in the kernel and the re-audited card has no finding left.
"""
from __future__ import annotations

import shutil

import pytest
from browser.lab_helpers import JS_NOTEBOOK_STATE as STATE
from browser.lab_helpers import WIDGET_NOTEBOOK_CELLS as CELLS
from browser.lab_helpers import WIDGETS_LABEXTENSION

pytestmark = pytest.mark.browser


@pytest.fixture
def lab(tmp_path):
    from browser.lab_helpers import LabServer

    if not WIDGETS_LABEXTENSION.exists():
        pytest.skip("jupyterlab_widgets' lab extension is not installed in this environment")
    shutil.copytree(WIDGETS_LABEXTENSION, tmp_path / "labextensions" / "@jupyter-widgets")
    server = LabServer(tmp_path).start()  # serves nbguard's built extension beside the widgets one
    yield server
    server.stop()


def _wait(page, predicate, what: str, seconds: float = 120):
    state = None
    for _ in range(int(seconds * 4)):
        state = page.evaluate(STATE, "widgets.ipynb")
        if state is not None and predicate(state):
            return state
        page.wait_for_timeout(250)
    raise AssertionError(f"timed out waiting for {what}; last state: {state}")


def test_widget_insert_cell_through_the_lab_extension_and_apply(lab):
    import nbformat
    from browser.lab_helpers import CHROMIUM, CHROMIUM_ARGS
    from playwright.sync_api import sync_playwright

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, lab.root / "widgets.ipynb")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"{lab.url}/lab/tree/widgets.ipynb")
            _wait(page, lambda s: s["kernel"] == "idle", "the kernel")
            page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
            _wait(page, lambda s: s["kernel"] == "idle" and all(c["n"] for c in s["cells"]), "Run All")

            card_cell = page.locator(".jp-Notebook .jp-Cell").nth(2)
            card_cell.locator("button", has_text="Insert cell").first.click()
            state = _wait(page, lambda s: len(s["cells"]) == 5, "the inserted fix cell")
            # directly below the card's cell, although the active cell is the last one after Run All
            assert "model.named_parameters()" in state["cells"][3]["source"]
            assert state["cells"][3]["n"] is None and state["cells"][4]["source"] == CELLS[3]
            card_cell.get_by_text("Inserted a cell below this output.").wait_for(timeout=30_000)

            card_cell.locator("button", has_text="Apply").first.click()
            card_cell.get_by_text("Fixed (gone after re-audit)").wait_for(timeout=60_000)
            # the audit's own output (peft may log a bitsandbytes CPU-kernel line to stderr first)
            header = card_cell.locator(".jp-OutputArea-output", has_text="nbguard precision audit").first.inner_text()
            assert "no findings" in header and "trainable-low-precision" in header
        finally:
            browser.close()
