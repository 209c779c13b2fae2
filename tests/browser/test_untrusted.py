"""A hostile notebook in a real JupyterLab: saved nbguard output is data, never an action.

The notebook comes from "someone else": unsigned (JupyterLab reports it untrusted). Its first saved
nbguard output has a fix card that says "verified" and offers four cells:

- a harmless statement, 400 spaces, then ``; open(MARKER, 'w').write('x')``: shown whole, wrapped;
- ``# fixed: pad right\rimport os; open(...)``: a bare carriage return, which a browser draws as a
  space (one comment line) while Python and CodeMirror break the line there: shown on two lines;
- a Trojan-source line (a right-to-left override and isolates that draw the comment outside the
  string) and a zero-width space: drawn in logical order, each such character marked;
- code with a vertical tab: refused, no button.

Each insertable one goes through the confirmation, and the cell inserted is compared with the string
the confirmation showed. The other outputs break the schema (issue 31): every palette colour a
``url()`` pointing at a local listener, a card tone that names nbguard's overlay class, code saved as
a JSON array, a right-to-left override in a fix id. Each must draw an inert notice and nothing else.
Nothing may run, and the page must fetch nothing from the listener.
"""
from __future__ import annotations

import http.server
import json
import threading
from pathlib import Path

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


RLO, LRI, PDI, ZWSP = "\u202e", "\u2066", "\u2069", "\u200b"

# The characters of the first line of a code box outside nbguard's marks, in logical order, with
# where the browser drew them: in a left-to-right line drawn in order, x only grows.
JS_FIRST_LINE = """(pre) => {
  const out = [];
  const walker = document.createTreeWalker(pre, NodeFilter.SHOW_TEXT);
  for (let n = walker.nextNode(); n; n = walker.nextNode()) {
    if (n.parentElement.closest('.nbg-mark')) { continue; }
    for (let i = 0; i < n.length; i++) {
      if (n.data[i] === '\\n') { return out; }
      if (n.data[i] === ' ') { continue; }
      const r = document.createRange(); r.setStart(n, i); r.setEnd(n, i + 1);
      const box = r.getBoundingClientRect();
      out.push([n.data[i], box.left, box.top]);
    }
  }
  return out;
}"""
# A plain <pre> holding `text` (no marks), appended to the page: the control of the measurements.
JS_PLAIN_PRE = """(text) => { const pre = document.createElement('pre'); pre.textContent = text;
  document.body.appendChild(pre); return pre; }"""
# The top of the first character of `word` in a code box's text (its first text node holding it).
JS_TOP_OF = """([pre, word]) => {
  const walker = document.createTreeWalker(pre, NodeFilter.SHOW_TEXT);
  for (let n = walker.nextNode(); n; n = walker.nextNode()) {
    const i = n.data.indexOf(word);
    if (i >= 0) { const r = document.createRange(); r.setStart(n, i); r.setEnd(n, i + 1); return r.getBoundingClientRect().top; }
  }
  return null;
}"""


def in_order(chars: list) -> bool:
    """One line, drawn left to right in logical order."""
    return len({round(top) for _, _, top in chars}) == 1 and all(a[1] < b[1] for a, b in zip(chars, chars[1:]))


def saved_payload(fixes: dict[str, str], output_id: str) -> dict:
    """The nbguard MIME data of a saved audit whose one finding offers `fixes` (id -> code), all "verified"."""
    doc = document("audit", title="audit", output_id=output_id,
                   findings=[Finding("demo-rule", "warning", "Demo finding", "detail", {}, list(fixes)).to_dict()],
                   fix_cells={fix_id: {"title": f"Fix {fix_id}", "code": code} for fix_id, code in fixes.items()})
    data = mime_bundle(doc)[MIME]
    offered = [f for s in data["view"]["sections"] for c in s.get("cards", []) for f in c.get("fixes", [])]
    assert sorted(f["id"] for f in offered) == sorted(fixes), "the view must offer the planted fixes"
    for fix in offered:
        fix["code"] = fixes[fix["id"]]  # exactly as planted, whatever the view would have made of it
        fix["verdict"] = {"status": "verified", "label": "verified", "detail": ""}
    return data


def first_card(data: dict) -> dict:
    return next(c for s in data["view"]["sections"] for c in s.get("cards", []) if c.get("fixes"))


def display(data: dict) -> dict:
    return {"output_type": "display_data", "data": {MIME: data, "text/plain": ["<nbguard>"]}, "metadata": {}}


def hostile_outputs(markers: dict[str, str], port: int) -> tuple[list[dict], dict[str, str]]:
    """The saved outputs of the hostile notebook, one per cell, and the codes of the first one's fixes."""
    codes = {
        "demo-fix": "model.config.use_cache = False" + " " * 400 + f"; open({markers['demo']!r},'w').write('x')",
        "cr-fix": f"# fixed: pad right\rimport os; open({markers['cr']!r},'w').write('x')",
        "bidi-fix": (f'access = "user{RLO} {LRI}# admin only{PDI} {LRI}"  # zero{ZWSP}width\n'
                     f'if access != "user":\n    open({markers["bidi"]!r},"w").write("x")'),
        "ctl-fix": f"x = 1\x0bopen({markers['ctl']!r},'w').write('x')",
    }
    fixes = display(saved_payload(codes, "saved-1"))

    # every palette colour a url() of the listener: fails the schema (#rrggbb)
    palette = saved_payload({"p-fix": "x = 1"}, "saved-2")
    evil = f"url(http://127.0.0.1:{port}/x)"
    colours = palette["view"]["palette"]
    for key in ("nan", "inf", "over", "missing", "skipped", "line", "good"):
        colours[key] = evil
    colours["severity"] = {"error": evil, "warning": evil, "info": evil}
    colours["scale"] = [evil, evil]
    # 13: a card that picks nbguard's full-screen overlay class, a fake dialog
    overlay = saved_payload({"o-fix": "x = 1"}, "saved-3")
    first_card(overlay)["tone"] = "error nbg-confirm-overlay"
    # 12: code saved as a JSON array (was shown joined with commas, inserted joined with nothing)
    array = saved_payload({"a-fix": "x = 1"}, "saved-4")
    first_card(array)["fixes"][0]["code"] = ["import os", f"open({markers['array']!r},'w').write('x')"]
    # 11: a right-to-left override in a fix id (garbled the confirmation's sentence)
    bidi_id = saved_payload({"i-fix": "x = 1"}, "saved-5")
    first_card(bidi_id)["fixes"][0]["id"] = f"switch-{RLO}precision"
    return [fixes, display(palette), display(overlay), display(array), display(bidi_id)], codes


def test_a_hostile_untrusted_notebook_runs_nothing_and_fetches_nothing(tmp_path, browser_page):
    page, _console_errors = browser_page
    listener = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Listener)
    threading.Thread(target=listener.serve_forever, daemon=True).start()
    lab = LabServer(tmp_path / "lab").start()
    try:
        markers = {name: str(tmp_path / f"MARKER-{name}") for name in ("demo", "cr", "bidi", "ctl", "array")}
        outputs, codes = hostile_outputs(markers, listener.server_address[1])
        path = "hostile.ipynb"
        cells = [{"cell_type": "code", "id": f"c{i}", "metadata": {}, "source": f"print({i})", "execution_count": i + 1,
                  "outputs": [output]} for i, output in enumerate(outputs)]
        cells.append({"cell_type": "code", "id": "last", "metadata": {}, "source": "x = 1", "execution_count": None,
                      "outputs": []})
        nb = {"cells": cells,
              "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"}},
              "nbformat": 4, "nbformat_minor": 5}
        (lab.root / path).write_text(json.dumps(nb))  # not signed: JupyterLab opens it untrusted
        n_cells = len(cells)

        page.goto(f"{lab.url}/lab/tree/{path}")
        fix_box = page.locator('.nbg-fix[data-fix="demo-fix"]')
        fix_box.wait_for(timeout=TIMEOUT_MS)
        wait_state(page, path, lambda s: s["kernel"] == "idle", "the kernel to start")

        # The outputs that break the schema: one inert notice each, naming the field, nothing else drawn.
        notebook_cells = page.locator(".jp-Notebook .jp-Cell")
        for index, field in [(1, "view.palette.nan"), (2, ".tone"), (3, ".code"), (4, ".id")]:
            output = notebook_cells.nth(index).locator(".jp-OutputArea-output")
            notice = output.locator(".nbg-invalid")
            notice.wait_for(timeout=TIMEOUT_MS)
            text = notice.text_content()
            assert "does not follow nbguard's document schema" in text and f"{field}: " in text, text
            assert output.locator("button, pre, .nbg-card, .nbg-report, [style]").count() == 0
            assert "nbg-confirm-overlay" not in text and "url(" not in text  # the values are never quoted
        assert page.locator(".nbg-confirm-overlay").count() == 0  # no fake dialog
        page.screenshot(path=str(ARTIFACTS / "untrusted-notices.png"), full_page=True)

        assert fix_box.locator("button.nbg-insert-run").count() == 0
        assert fix_box.locator(".nbg-verdict-verified").text_content() == "verified when saved"
        assert fix_box.locator(".nbg-saved-mark").text_content() == "from a saved file"
        shown = fix_box.locator("pre.nbg-code")
        assert shown.text_content() == codes["demo-fix"]
        assert shown.evaluate("e => getComputedStyle(e).whiteSpace") == "pre-wrap"
        assert shown.evaluate("e => e.scrollWidth <= e.clientWidth + 1")  # nothing hidden to the right
        # the stylesheet wraps too, without the inline style (it used to end with white-space: pre)
        assert shown.evaluate("e => { const v = e.style.whiteSpace; e.style.whiteSpace = '';"
                              " const w = getComputedStyle(e).whiteSpace; e.style.whiteSpace = v; return w; }") == "pre-wrap"

        # A cell holding a control character other than tab and newline is refused: no button.
        refused = page.locator('.nbg-fix[data-fix="ctl-fix"]')
        assert refused.locator("button").count() == 0
        assert "U+000B" in refused.locator(".nbg-fix-refused").text_content()

        # Each insertable fix: the confirmation shows the cell, and the cell inserted is that string.
        expected = {"demo-fix": codes["demo-fix"], "cr-fix": codes["cr-fix"].replace("\r", "\n"),
                    "bidi-fix": codes["bidi-fix"]}
        for fix_id, source in expected.items():
            box = page.locator(f'.nbg-fix[data-fix="{fix_id}"]')
            assert box.locator("button").count() == 1
            folded = page.locator("details.nbg-fix-others:not([open]) > summary")
            if not box.is_visible() and folded.count():  # a fix after the first waits under "N other fixes"
                folded.first.click()
            box.locator("button.nbg-insert").click()
            dialog = page.locator(".nbg-confirm")
            dialog.wait_for(timeout=TIMEOUT_MS)
            pre = dialog.locator("pre")
            shown_text = pre.text_content()
            assert shown_text == source
            assert pre.evaluate("e => getComputedStyle(e).whiteSpace") == "pre-wrap"
            assert "come from a saved file" in dialog.text_content()
            if fix_id == "cr-fix":
                # 10: the hidden statement is on a line of its own, where a plain <pre> shows one line
                handle = pre.element_handle()
                assert page.evaluate(JS_TOP_OF, [handle, "import"]) > page.evaluate(JS_TOP_OF, [handle, "#"]) + 5
                plain = page.evaluate_handle(JS_PLAIN_PRE, codes["cr-fix"])
                assert page.evaluate(JS_TOP_OF, [plain, "import"]) == page.evaluate(JS_TOP_OF, [plain, "#"]), \
                    "control: a browser draws a bare \\r as no line break"
                plain.evaluate("e => e.remove()")
            if fix_id == "bidi-fix":
                # 11: drawn in logical order (the comment stays inside the string), each control marked
                chars = pre.evaluate(JS_FIRST_LINE)
                assert "".join(c for c, _, _ in chars).startswith('access="user#adminonly"#zero'), chars
                assert in_order(chars), chars
                plain = page.evaluate_handle(JS_PLAIN_PRE, codes["bidi-fix"])
                assert not in_order(page.evaluate(JS_FIRST_LINE, plain)), "control: unmarked, the override reorders the line"
                plain.evaluate("e => e.remove()")
                marks = pre.locator(".nbg-mark")
                assert [marks.nth(i).get_attribute("data-mark") for i in range(marks.count())] == [
                    "U+202E", "U+2066", "U+2069", "U+2066", "U+200B"]
                for i in range(marks.count()):
                    assert marks.nth(i).evaluate("e => getComputedStyle(e, '::before').content") == \
                        f'"{marks.nth(i).get_attribute("data-mark")}"'
                    assert marks.nth(i).evaluate("e => e.getBoundingClientRect().width") > 8  # visible
            page.screenshot(path=str(ARTIFACTS / f"untrusted-confirm-{fix_id}.png"), full_page=True)
            dialog.locator("button.nbg-confirm-insert").click()
            n_cells += 1
            state = wait_state(page, path, lambda s, n=n_cells: len(s["cells"]) == n, f"the confirmed insert of {fix_id}")
            inserted = state["cells"][1]  # directly below the output's cell
            assert inserted["source"] == shown_text, fix_id  # the inserted cell is the string shown
            assert inserted["execution_count"] is None
        page.wait_for_timeout(3000)  # time for anything that would run or fetch to do so
        state = page.evaluate(JS_STATE, path)
        assert [c["source"] for c in state["cells"][1:4]] == [expected["bidi-fix"], expected["cr-fix"], expected["demo-fix"]]
        assert all(c["execution_count"] is None for c in state["cells"][1:4])
        assert [name for name, marker in markers.items() if Path(marker).exists()] == []
        assert Listener.seen == []
        # the control: this page can reach the listener, so an empty log means nothing was fetched
        port = listener.server_address[1]
        page.evaluate(f"() => fetch('http://127.0.0.1:{port}/control', {{mode: 'no-cors'}}).catch(() => null)")
        page.wait_for_timeout(1000)
        assert Listener.seen == ["/control"]
    finally:
        lab.stop()
        listener.shutdown()
