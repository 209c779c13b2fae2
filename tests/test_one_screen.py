"""Issue 41: each output fits one screen, names one recommended fix, and tells the story in the order it happened.

The quickstart's objects, run for real: a tiny Gemma 3 in fp16 whose rare token overflows layer 0 from step 2,
audited for a T4, watched with skip, fixed with the recommended fix, run again. The text/plain of each magic's
output is measured in lines; the static HTML is counted in code blocks and heatmaps; the recommended fix is
read off the audit, the watch's card, the report's headline and the quickstart's docs, and must be one fix.
"""
from __future__ import annotations

import re
from pathlib import Path

import ipywidgets as W
import pytest
import torch
from notebook_helpers import run, shell  # noqa: F401 - the fixture
from quickstart_helpers import RARE, Stream, quickstart_into

import nbguard
from nbguard.document.view import recommended_fix, view
from nbguard.notebook.present import OPEN_VIEWS
from nbguard.render import render_html
from nbguard.session import SESSION
from nbguard.testing import plant_fp16_overflow_token, tiny_gemma3

ONE_SCREEN = 40  # lines of text/plain
ROOT = Path(__file__).resolve().parents[1]


def _story_fix(doc: dict) -> str:
    """The fix the headline ("What happened") names."""
    story = view(doc).section("story")
    assert story is not None
    line = next(f.text for f in story.facts if f.text.startswith("Fix: "))
    return line.split()[1]


def _code_blocks(html: str) -> list[str]:
    return re.findall(r"<pre><code>(.*?)</code></pre>", html, re.S)


def _visible_insert_buttons(widget) -> int:
    """Insert buttons a reader sees without a click: a collapsed Accordion's rows are not counted."""
    if isinstance(widget, W.Accordion) and widget.selected_index is None:
        return 0
    own = int(isinstance(widget, W.Button) and widget.description == "Insert cell")
    return own + sum(_visible_insert_buttons(child) for child in getattr(widget, "children", ()))


def test_the_quickstart_outputs_fit_one_screen_and_name_one_fix(shell, tmp_path):  # noqa: F811
    quickstart_into(shell, tmp_path)
    audit = run(shell, "%precision_check trainer --hardware t4")
    assert audit.error is None
    [audit_out] = audit.outputs
    audit_text = audit_out["text/plain"]
    assert len(audit_text.splitlines()) <= ONE_SCREEN, audit_text
    assert "trainer.args.fp16 = False" not in audit_text  # the cells are a call away, said on the last lines
    assert "full=True" in audit_text
    # the widget: one Insert button in sight, the recommended fix's; every other fix folded
    findings_view = next(v for v in reversed(OPEN_VIEWS) if hasattr(v, "fix_row"))
    assert _visible_insert_buttons(findings_view.widget) == 1
    assert findings_view.rows["fp16-overflow-risk"][0].fix_id == "switch-precision"

    watched = run(shell, "%%nanwatch trainer --policy skip\ntrainer.train()")
    assert watched.error is None
    final = watched.updates[-1]  # the dashboard's static copy, brought up to date when the run ended
    watch_text = final["text/plain"]
    assert len(watch_text.splitlines()) <= ONE_SCREEN, watch_text
    assert "import torch" not in watch_text and "full=True" in watch_text
    html = final["text/html"]
    blocks = _code_blocks(html)
    assert blocks and len(blocks) == len(set(blocks))  # each fix's cell once, though two cards offer it
    assert "<details open" not in html  # every cell a click away
    assert html.count('alt="gradient-norm heatmap') == 1  # the story's heatmap is the watch's own: drawn once

    audit_doc = SESSION.last_audit.to_document()
    watch_doc = SESSION.watches[-1].to_document()
    event_card = next(c for s in view(watch_doc).sections if s.kind == "watch" for c in s.cards)
    recommended = {
        "audit headline": _story_fix(audit_doc),
        "watch headline": _story_fix(watch_doc),
        "watch card": recommended_fix(event_card.fixes).id,
        "watch card text": re.search(r"fix: (\S+) \[verified\]", watch_text).group(1),
        "watch card HTML": re.search(r"recommended fix <code>([^<]+)</code>", html).group(1),
    }
    fix = recommended["audit headline"]
    quickstart_docs = (ROOT / "docs/guides/quickstart.md").read_text()
    assert f"%nbguard fix {fix} --apply" in quickstart_docs
    assert recommended == dict.fromkeys(recommended, fix) and fix == "switch-precision", recommended

    assert run(shell, f"%nbguard fix {fix} --apply").error is None
    report = nbguard.report().to_dict()
    assert _story_fix(report) == fix
    story = [f.text for f in view(report).section("story").facts]
    assert f"Applied: {fix}: this cell verified on the failing step" in " ".join(story)
    report_html = render_html(report, standalone=True)
    blocks = _code_blocks(report_html)
    assert blocks and len(blocks) == len(set(blocks))  # the applied cell is the verified one: shown once


def _poisoned_gemma():
    model = tiny_gemma3(seed=0)
    plant_fp16_overflow_token(model, RARE)
    return model.to(torch.float16)


def _train_under_fp16_autocast(model, steps: int = 4):
    """A plain loop under fp16 autocast: upcast weights still compute layer 0 in fp16, so step 2 overflows."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rows = list(Stream())
    with nbguard.watch(model, optimizer=opt, policy="skip") as watch:
        for step in range(steps):
            batch = {k: torch.stack([r[k] for r in rows[4 * step:4 * step + 4]]) for k in rows[0]}
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(**batch).loss
            loss.backward()
            opt.step()
    return watch


def test_the_report_tells_the_python_guide_in_the_order_it_happened():
    """docs/guides/python.md: audit, fixes.apply, then the watch, then report(audit=, watch=). The fix came before
    the watch; the watch's run is the run after the fix; the verdict the watch measured with the fix already in
    place (it changes nothing: it was applied) is not the applied cell's proof."""
    model = _poisoned_gemma()
    result = nbguard.audit(model, hardware="t4")
    nbguard.fixes.apply("upcast-trainable-fp32", model=model)
    watch = _train_under_fp16_autocast(model)
    assert watch.events and watch.events[0].step == 2

    report = nbguard.report(audit=result, watch=watch).to_dict()
    assert [e["kind"] for e in report["entries"]] == ["audit", "fix", "watch"]
    titles = [s.title for s in view(report).sections if s.kind == "entry"]
    assert [t.split(" (")[0] for t in titles] == ["1. Audit: 2 findings", "2. Fix applied: upcast-trainable-fp32",
                                                  "3. Watch"]
    story = [f.text for f in view(report).section("story").facts]
    applied = next(t for t in story if t.startswith("Applied: "))
    assert applied == "Applied: upcast-trainable-fp32: this cell was not run on a failing step: not verified"
    assert "changes nothing" not in " ".join(story)
    after = next(t for t in story if t.startswith("Run after the fix: "))
    assert after.startswith("Run after the fix: 4 steps, 1 event; first: step 2")
