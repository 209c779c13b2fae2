"""A hostile notebook in a real JupyterLab: saved nbguard output is data, never an action.

The notebook comes from "someone else": unsigned (JupyterLab reports it untrusted), with a saved
nbguard output whose fix card says "verified" and whose code is a harmless statement, 400 spaces,
then ``; open(MARKER, 'w').write('x')``; every palette colour is a ``url()`` pointing at a local
listener. Clicking every button (and every button of the confirmation) must run nothing, the
page must fetch nothing from the listener, and the code must be shown whole, wrapped.
"""
from __future__ import annotations

import http.server
import json
import threading

import pytest

from nbguard.findings import Finding, document
from nbguard.render import mime_bundle

from .lab_helpers import ARTIFACTS, LabServer, free_port
from .test_lab import JS_STATE, TIMEOUT_MS, browser_page, wait_state  # noqa: F401  (browser_page: a fixture)

pytestmark = pytest.mark.browser

MIME = "application/vnd.nbguard.v1+json"


class Listener(http.server.BaseHTTPRequestHandler):
    """Records every request: a fetched palette url() would land here."""

    seen: list[str] = []

    def do_GET(self):  # noqa: N802 (http.server's name)
        Listener.seen.append(self.path)
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args):  # quiet
        pass


def hostile_output(marker: str, port: int) -> tuple[dict, str]:
    """A saved display_data output as a stranger's notebook would carry it, and its fix code."""
    code = "model.config.use_cache = False" + " " * 400 + f"; open({marker!r},'w').write('x')"
    doc = document("audit", title="audit", output_id="saved-1",
                   findings=[Finding("demo-rule", "warning", "Demo finding", "detail", {}, ["demo-fix"]).to_dict()],
                   fix_cells={"demo-fix": {"title": "Demo fix", "code": code}})
    bundle = mime_bundle(doc)
    view = bundle[MIME]["view"]
    evil = f"url(http://127.0.0.1:{port}/x)"
    palette = view["palette"]
    for key in ("nan", "inf", "over", "missing", "skipped", "line", "good"):
        palette[key] = evil
    palette["severity"] = {"error": evil, "warning": evil, "info": evil}
    palette["scale"] = [evil, evil]
    fixes = [f for s in view["sections"] for c in s.get("cards", []) for f in c.get("fixes", []) if f["id"] == "demo-fix"]
    assert fixes, "the view must offer the planted fix"
    for fix in fixes:
        fix["verdict"] = {"status": "verified", "label": "verified", "detail": ""}
    return {"output_type": "display_data", "data": bundle, "metadata": {}}, code


def test_a_hostile_untrusted_notebook_runs_nothing_and_fetches_nothing(tmp_path, browser_page):
    page, _console_errors = browser_page
    listener = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Listener)
    threading.Thread(target=listener.serve_forever, daemon=True).start()
    lab = LabServer(tmp_path / "lab").start()
    try:
        marker = tmp_path / "MARKER"
        output, code = hostile_output(str(marker), listener.server_address[1])
        path = "hostile.ipynb"
        nb = {"cells": [{"cell_type": "code", "id": "c0", "metadata": {}, "source": "print('hi')",
                         "execution_count": 1, "outputs": [output]},
                        {"cell_type": "code", "id": "c1", "metadata": {}, "source": "x = 1", "execution_count": None,
                         "outputs": []}],
              "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"}},
              "nbformat": 4, "nbformat_minor": 5}
        (lab.root / path).write_text(json.dumps(nb))  # not signed: JupyterLab opens it untrusted

        page.goto(f"{lab.url}/lab/tree/{path}")
        fix_box = page.locator('.nbg-fix[data-fix="demo-fix"]')
        fix_box.wait_for(timeout=TIMEOUT_MS)
        wait_state(page, path, lambda s: s["kernel"] == "idle", "the kernel to start")

        assert fix_box.locator("button.nbg-insert-run").count() == 0
        assert fix_box.locator(".nbg-verdict-verified").text_content() == "verified when saved"
        assert fix_box.locator(".nbg-saved-mark").text_content() == "from a saved file"
        shown = fix_box.locator("pre.nbg-code")
        assert shown.text_content() == code
        assert shown.evaluate("e => getComputedStyle(e).whiteSpace") == "pre-wrap"
        assert shown.evaluate("e => e.scrollWidth <= e.clientWidth + 1")  # nothing hidden to the right

        # Click every button of the output; the confirmation shows the whole cell, wrapped.
        buttons = page.locator(".jp-OutputArea-output button")
        for i in range(buttons.count()):
            buttons.nth(i).click()
            dialog = page.locator(".nbg-confirm")
            if dialog.count():
                assert dialog.locator("pre").text_content() == code
                assert dialog.locator("pre").evaluate("e => getComputedStyle(e).whiteSpace") == "pre-wrap"
                assert "come from a saved file" in dialog.text_content()
                page.screenshot(path=str(ARTIFACTS / "untrusted-confirm.png"), full_page=True)
                dialog.locator("button.nbg-confirm-insert").click()
        state = wait_state(page, path, lambda s: len(s["cells"]) == 3, "the confirmed insert")
        page.wait_for_timeout(3000)  # time for anything that would run or fetch to do so
        state = page.evaluate(JS_STATE, path)
        assert state["cells"][1]["source"] == code and state["cells"][1]["execution_count"] is None
        assert not marker.exists()
        assert Listener.seen == []
        # the control: this page can reach the listener, so an empty log means nothing was fetched
        port = listener.server_address[1]
        page.evaluate(f"() => fetch('http://127.0.0.1:{port}/control', {{mode: 'no-cors'}}).catch(() => null)")
        page.wait_for_timeout(1000)
        assert Listener.seen == ["/control"]
    finally:
        lab.stop()
        listener.shutdown()
