"""nbguard's renderer hosts the live widget while its model is alive, and shows its own view after.

``%precision_check`` displays ONE output carrying the widget view and the nbguard document. In a
real JupyterLab with ipywidgets' lab extension (Chromium, Playwright): the live widget is shown
(one view, its buttons); after a kernel restart, and after a page reload with the restarted kernel,
nbguard's static view of the saved document is shown instead of ipywidgets' "Error displaying
widget: model not found", and its "Insert fix cell" still inserts the fix below the card's cell;
run again and reloaded with the kernel still running, the restored widget is shown again.
(The restart comes before any reload: a restart right after a page load cancels JupyterLab's own
debugger request, whose console error is unrelated to nbguard.)
"""
from __future__ import annotations

import json
import shutil

import pytest

from .lab_helpers import ARTIFACTS, CHROMIUM, CHROMIUM_ARGS, WIDGETS_LABEXTENSION, LabServer
from .lab_helpers import JS_NOTEBOOK_STATE as JS_STATE
from .lab_helpers import WIDGET_NOTEBOOK_CELLS as CELLS

pytestmark = pytest.mark.browser

MIME = "application/vnd.nbguard.v1+json"
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
RULE = "trainable-low-precision"
TIMEOUT_MS = 120_000  # two shared cores: kernel start + torch import can be slow
PATH = "host.ipynb"
# nbguard's outputs, not library log lines on stderr (bitsandbytes' CPU backend logs a warning when
# the audit first imports it: "Failed to load CPU gemm_4bit_forward from kernels-community").
OUTPUTS = '.jp-OutputArea-output:not([data-mime-type="application/vnd.jupyter.stderr"])'
JS_RESTART = """(path) => { const panel = Array.from(window.jupyterapp.shell.widgets('main'))
  .find(w => w.context && w.context.path === path);
  return panel.sessionContext.session.kernel.restart(); }"""
# Which of the hosted output's two views are displayed: the static one, the widget, or both.
JS_SHOWN = """(cell) => { const host = cell.querySelector('.nbg-widget-host');
  if (!host) { return null; }
  const shown = Array.from(host.children).filter(c => c.offsetParent !== null);
  return shown.map(c => c.classList.contains('nbg-static') ? 'static' : 'widget'); }"""


@pytest.fixture
def lab(tmp_path):
    if not WIDGETS_LABEXTENSION.exists():
        pytest.skip("jupyterlab_widgets' lab extension is not installed in this environment")
    shutil.copytree(WIDGETS_LABEXTENSION, tmp_path / "labextensions" / "@jupyter-widgets")
    server = LabServer(tmp_path).start()  # nbguard's built extension beside the widgets one
    yield server
    server.stop()


def _wait(page, predicate, what: str, seconds: float = TIMEOUT_MS / 1000):
    state = None
    for _ in range(int(seconds * 4)):
        state = page.evaluate(JS_STATE, PATH)
        if state is not None and predicate(state):
            return state
        page.wait_for_timeout(250)
    raise AssertionError(f"timed out waiting for {what}; last state: {state}")


def _wait_shown(page, cell, expected: list[str], what: str) -> None:
    """Wait until exactly ``expected`` views of the hosted output are displayed."""
    shown = None
    for _ in range(int(TIMEOUT_MS / 250)):
        shown = cell.evaluate(JS_SHOWN)
        if shown == expected:
            return
        page.wait_for_timeout(250)
    raise AssertionError(f"timed out waiting for {what}: shown {shown}, expected {expected}")


def _assert_no_widget_error(page) -> None:
    text = page.locator(".jp-Notebook").inner_text()
    assert "model not found" not in text and "Error displaying widget" not in text, text


def test_live_widget_then_static_view_after_kernel_restart_and_reload(lab):
    import nbformat
    from playwright.sync_api import sync_playwright

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, lab.root / PATH)
    console_errors: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.on("console", lambda m: console_errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: console_errors.append(f"pageerror: {e}"))
            page.goto(f"{lab.url}/lab/tree/{PATH}")
            _wait(page, lambda s: s["kernel"] == "idle", "the kernel")
            page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
            _wait(page, lambda s: s["kernel"] == "idle" and all(c["n"] for c in s["cells"]), "Run All")

            # Live: one output, drawn by nbguard's renderer hosting the widget; only the widget shows.
            card_cell = page.locator(".jp-Notebook .jp-Cell").nth(2)
            _wait_shown(page, card_cell, ["widget"], "the live widget")
            assert card_cell.locator(OUTPUTS).count() == 1
            assert card_cell.locator(".jp-OutputArea-output.nbg-renderer").count() == 1
            assert card_cell.locator("button:visible", has_text="Apply").count() >= 1
            assert card_cell.locator("button:visible", has_text="Insert cell").count() >= 1
            assert card_cell.locator("button.nbg-insert:visible").count() == 0  # the static view is hidden
            page.screenshot(path=str(ARTIFACTS / "10-hosted-live-widget.png"), full_page=True)

            page.evaluate("() => window.jupyterapp.commands.execute('docmanager:save')")
            _wait(page, lambda s: not s["dirty"], "the save")
            saved = json.loads((lab.root / PATH).read_text())
            data = next(o["data"] for o in saved["cells"][2]["outputs"] if MIME in o.get("data", {}))
            assert WIDGET_MIME in data  # the saved output still carries the (soon dead) widget view
            fix_id = next(f for f in data[MIME]["findings"] if f["rule"] == RULE)["fixes"][0]
            fix_code = data[MIME]["fix_cells"][fix_id]["code"]

            # Kernel restart: the widget's model is gone, so nbguard's own view replaces the dead widget.
            page.evaluate(JS_RESTART, PATH)
            _wait(page, lambda s: s["kernel"] == "idle", "the restarted kernel")
            _wait_shown(page, card_cell, ["static"], "the static view after the restart")
            _assert_no_widget_error(page)

            # Reload with the restarted kernel: the saved output shows nbguard's view of the saved data.
            page.reload()
            _wait(page, lambda s: s["kernel"] == "idle", "the kernel after the reload")
            card_cell = page.locator(".jp-Notebook .jp-Cell").nth(2)
            card = card_cell.locator(f'.nbg-card[data-rule="{RULE}"]')
            card.wait_for(timeout=TIMEOUT_MS)
            _wait_shown(page, card_cell, ["static"], "the static view after the reload")
            page.wait_for_timeout(2000)  # the kernel has answered the hosting check by now: nothing swaps in
            assert card_cell.evaluate(JS_SHOWN) == ["static"]
            assert card_cell.locator(OUTPUTS).count() == 1
            assert card_cell.locator("button:visible", has_text="Apply").count() == 0
            _assert_no_widget_error(page)
            page.screenshot(path=str(ARTIFACTS / "11-hosted-static-after-restart.png"), full_page=True)

            # Its "Insert fix cell" inserts the saved fix directly below the card's cell, without running it.
            card.locator(f'.nbg-fix[data-fix="{fix_id}"] button.nbg-insert').click()
            card.locator(".nbg-fix-status", has_text="Inserted below.").wait_for(timeout=30_000)
            state = _wait(page, lambda s: len(s["cells"]) == len(CELLS) + 1, "the inserted fix cell")
            assert state["cells"][3]["source"] == fix_code and state["cells"][3]["n"] is None
            assert state["cells"][4]["source"] == CELLS[3]

            # Run again: the card is live again; reloaded with the kernel still running, the widget
            # manager restores the model and the widget is back in place of the static view.
            page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
            _wait(page, lambda s: s["kernel"] == "idle" and all(c["n"] for c in s["cells"]), "the second Run All")
            _wait_shown(page, card_cell, ["widget"], "the live widget after re-running")
            page.evaluate("() => window.jupyterapp.commands.execute('docmanager:save')")
            _wait(page, lambda s: not s["dirty"], "the second save")
            page.reload()
            _wait(page, lambda s: s["kernel"] == "idle", "the kernel after the second reload")
            card_cell = page.locator(".jp-Notebook .jp-Cell").nth(2)
            _wait_shown(page, card_cell, ["widget"], "the restored widget after a reload")
            assert card_cell.locator("button:visible", has_text="Apply").count() >= 1
            _assert_no_widget_error(page)
        finally:
            browser.close()
    assert console_errors == [], "console errors in JupyterLab:\n" + "\n".join(console_errors)
