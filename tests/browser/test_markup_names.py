"""#40 finding 8 in a real browser: a module named ``head" onmouseover="alert(1)" x="`` (torch refuses only "." in
a name) reaches the watch dashboard's layer view, an ipywidgets HTML whose value the browser parses as markup
(innerHTML). In JupyterLab with ipywidgets' lab extension (Debian's Chromium, Playwright): the name sits inside the
sparkline's aria-label, no element anywhere carries an onmouseover attribute, and hovering it fires no alert."""
from __future__ import annotations

import shutil

import pytest

from .lab_helpers import ARTIFACTS, CHROMIUM, CHROMIUM_ARGS, REPO_ROOT, WIDGETS_LABEXTENSION, LabServer, write_notebook
from .lab_helpers import JS_NOTEBOOK_STATE as JS_STATE

pytestmark = pytest.mark.browser

PAYLOAD = 'head" onmouseover="alert(1)" x="'
PATH = "names.ipynb"
TIMEOUT_MS = 180_000  # two shared cores: kernel start, torch import and three watched steps
CELLS = [
    f"import sys\nsys.path[:0] = [{str(REPO_ROOT)!r}, {str(REPO_ROOT / 'tests')!r}]\n"
    "import torch, nbguard\nfrom IPython.display import display\n"
    "from dashboard_helpers import every_step_dashboard\nfrom test_markup_escaping import PAYLOAD, PayloadNet",
    "model = PayloadNet()\nopt = torch.optim.SGD(model.parameters(), lr=0.01)\n"
    "x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))\n"
    "with nbguard.watch(model, optimizer=opt) as watch:\n"
    "    dash = every_step_dashboard(watch)\n"
    "    for _ in range(3):\n"
    "        opt.zero_grad(); model(x).pow(2).mean().backward(); opt.step()\n"
    "    dash.finish()\n"
    "dash.layer.value = next(g for g in dash.layer.options if PAYLOAD in g)\n"
    "display(dash.widget)\ndisplay(watch)",
]
# Every element's attribute names that start with "on", and the aria-labels that hold the payload.
JS_HANDLERS = """() => Array.from(document.querySelectorAll('*')).flatMap(e =>
  Array.from(e.attributes).filter(a => a.name.toLowerCase().startsWith('on')).map(a => e.tagName + ' ' + a.name))"""
JS_LABELS = """(payload) => Array.from(document.querySelectorAll('[aria-label]'))
  .map(e => e.getAttribute('aria-label')).filter(v => v.includes(payload))"""


@pytest.fixture
def lab(tmp_path):
    if not WIDGETS_LABEXTENSION.exists():
        pytest.skip("jupyterlab_widgets' lab extension is not installed in this environment")
    shutil.copytree(WIDGETS_LABEXTENSION, tmp_path / "labextensions" / "@jupyter-widgets")
    server = LabServer(tmp_path).start()
    yield server
    server.stop()


def _wait(page, predicate, what: str):
    state = None
    for _ in range(int(TIMEOUT_MS / 250)):
        state = page.evaluate(JS_STATE, PATH)
        if state is not None and predicate(state):
            return state
        page.wait_for_timeout(250)
    raise AssertionError(f"timed out waiting for {what}; last state: {state}")


def test_a_module_name_with_an_attribute_payload_stays_an_attribute_value(lab):
    from playwright.sync_api import sync_playwright

    write_notebook(lab.root / PATH, [("code", c) for c in CELLS])
    dialogs: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
            page.goto(f"{lab.url}/lab/tree/{PATH}")
            _wait(page, lambda s: s["kernel"] == "idle", "the kernel")
            page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
            _wait(page, lambda s: s["kernel"] == "idle" and all(c["n"] for c in s["cells"]), "Run All")
            labelled = page.locator(".jp-Notebook svg[aria-label]").filter(has=page.locator("polyline"))
            # the dashboard's sparklines (loss, grad norm) and the layer view's are drawn
            page.wait_for_function("() => document.querySelectorAll('.jp-Notebook svg[role=img]').length >= 3",
                                   timeout=TIMEOUT_MS)
            page.wait_for_timeout(1000)
            assert page.evaluate(JS_HANDLERS) == []  # before the fix: ['svg onmouseover'] in the layer view
            assert PAYLOAD in page.evaluate(JS_LABELS, PAYLOAD)  # the whole name, as the attribute's value
            text = page.locator(".jp-Notebook").inner_text()
            assert "Error displaying widget" not in text and "Traceback" not in text, text
            for i in range(labelled.count()):  # hover every sparkline: nothing to fire
                labelled.nth(i).hover()
            page.wait_for_timeout(500)
            page.screenshot(path=str(ARTIFACTS / "40-markup-names.png"), full_page=True)
            assert dialogs == []
        finally:
            browser.close()
