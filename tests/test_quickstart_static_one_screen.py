"""Issue 41, one screen, in the static HTML (VS Code, Colab, nbconvert, GitHub): a failing watch's output keeps its
event card in sight (what went wrong and where in its title, the recommended fix and its verdict) and folds the
detail under one line each (the event's origin table and evidence; the table of the fixes run on the failing
step), as the Lab view does (labextension/test/onescreen.test.ts)."""
from __future__ import annotations

import re

from view_helpers import real_payloads

from nbguard.document.view import view
from nbguard.render import render_html
from nbguard.render.html import esc


def test_the_fixes_run_on_a_failing_step_are_one_click_away():
    doc = {k: v for k, v in real_payloads()["watch"].items() if k != "view"}
    watch = view(doc).section("watch")
    assert watch is not None
    [event] = [c for c in watch.cards if c.tone != "info"]
    [fixes_run] = [c for c in watch.cards if c.tone == "info"]
    assert fixes_run.table is not None and fixes_run.fixes == []  # its fixes are the event card's own
    html = render_html(doc)
    label = f"{fixes_run.title}: each fix&#x27;s verdict and measurements ({len(fixes_run.table.rows)})"
    folded = re.search(rf"<details><summary>{re.escape(label)}</summary>(.*?)</details>", html, re.S)
    assert folded is not None, "the table of the fixes run is not under one fold"
    assert "<table>" in folded.group(1) and fixes_run.table.columns[0] in folded.group(1)
    # the event's own card is in sight: above the fold, and no fold left open around it
    before_fold = html[:folded.start()]
    assert esc(event.title) in before_fold
    assert before_fold.count("<details>") == before_fold.count("</details>")
    # its title says what and where; its origin table and evidence wait under one line of it
    assert event.table is not None and event.folds
    origins = len(event.table.rows)
    detail = f"<details><summary>where it was born: {origins} origin{'' if origins == 1 else 's'} and evidence</summary><table>"
    assert detail in before_fold[before_fold.index(esc(event.title)):]
