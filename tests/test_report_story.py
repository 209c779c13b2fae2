"""The HTML report of a real planted-fault run tells the story on its first screen, in real Chromium:
what went wrong, where, and the fix, one line each, with every detail folded."""
from __future__ import annotations

import shutil

import pytest
from report_helpers import watched_run_with_planted_fault

import nbguard
from nbguard.document.view import view

VIEWPORT = {"width": 1280, "height": 800}


@pytest.fixture(scope="module")
def planted_report(tmp_path_factory):
    _, watch = watched_run_with_planted_fault(steps=4, bad_step=2, policy="skip")
    path = tmp_path_factory.mktemp("report") / "report.html"
    report = nbguard.report(watch=watch)
    report.save(path)
    return report, path


def test_the_story_is_the_first_section_of_the_view(planted_report):
    report, _ = planted_report
    story = view(report.to_dict()).sections[0]
    assert story.kind == "story"
    what, where, fix = (f.text for f in story.facts)
    assert what == "What went wrong: step 2: non-finite loss (overflow)"
    assert where.startswith("Where: model.layers.1.mlp.down_proj") and "(forward, float32)" in where
    # The planted overflow is in fp32 weights: no offered fix makes it finite, and the story says so.
    assert fix.startswith("Fix: none verified on the failing step") and "enable-grad-clipping not enough" in fix


@pytest.mark.browser
def test_first_screen_tells_the_story_and_details_are_closed(planted_report, tmp_path):
    from browser.lab_helpers import CHROMIUM, CHROMIUM_ARGS
    from playwright.sync_api import sync_playwright

    if not shutil.which(CHROMIUM):
        pytest.skip(f"no Chromium at {CHROMIUM}")
    _, path = planted_report
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport=VIEWPORT)
            page.goto(path.as_uri())
            page.screenshot(path=str(tmp_path / "first-screen.png"))
            for line in ("What went wrong: step 2", "Where: model.layers.1.mlp.down_proj", "Fix: none verified"):
                box = page.get_by_text(line).bounding_box()
                assert box is not None and box["y"] + box["height"] <= VIEWPORT["height"], line
            opened = page.evaluate("() => [...document.querySelectorAll('details')].filter(d => d.open).length")
            folds = page.evaluate("() => document.querySelectorAll('details').length")
            assert folds > 0 and opened == 0  # nothing verified: no fix is recommended, every fold closed
            assert "&quot;absmax&quot;" not in path.read_text() and '"headroom": null' not in page.content()
        finally:
            browser.close()
