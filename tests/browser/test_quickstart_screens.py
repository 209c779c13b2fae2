"""The quickstart seen in Chromium: the dashboard in the executed notebook's static HTML and the first
screen of its report both show the turn, read from the pixels of the screenshots (saved to
test-artifacts/browser/ for a person to look at).

A "turn" is a row of pixels where a run of healthy colours (the heatmap's viridis scale of grad norms,
or the palette's "good" colour) is followed, to its right, by a run of the NaN colour: steps 0-3
healthy, steps 4-7 non-finite.
"""
from __future__ import annotations

import importlib.util
import io
from pathlib import Path

import pytest

from browser.lab_helpers import ARTIFACTS, CHROMIUM, CHROMIUM_ARGS, REPO_ROOT
from nbguard.document.palette import GOOD_COLOR, NAN_COLOR, SCALE

pytestmark = [pytest.mark.browser, pytest.mark.slow]

MIN_RUN_PX = 30  # a heatmap cell of the dashboard is wider than this
REPORT_MIN_RUN_PX = 12  # the report's first screen may draw the heatmap smaller
FIRST_SCREEN = {"width": 1280, "height": 800}


def _rgb(color: str) -> tuple[int, int, int]:
    return tuple(int(color[i:i + 2], 16) for i in (1, 3, 5))  # type: ignore[return-value]


def _scale_samples(steps_between: int = 16):
    """The healthy colours: the heatmap's ramp, sampled between its stops (cells take any colour along
    it), and the palette's "good" colour (a view may mark healthy steps with it instead)."""
    import numpy as np

    stops = np.array([_rgb(c) for c in SCALE], dtype=float)
    t = np.linspace(0, 1, steps_between, endpoint=False)[:, None]
    samples = [a + (b - a) * t for a, b in zip(stops, stops[1:])]
    return np.concatenate(samples + [stops[-1:], np.array([_rgb(GOOD_COLOR)], dtype=float)])


def _labels(png: bytes, tolerance: float = 14.0):
    """Every other pixel row of the image, each pixel labelled 1 (NaN colour), 2 (on the healthy
    scale) or 0 (anything else: background, text, hatching, anti-aliasing)."""
    import numpy as np
    from PIL import Image

    rgb = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=float)[::2]
    nan = ((rgb - np.array(_rgb(NAN_COLOR))) ** 2).sum(-1) <= tolerance ** 2
    samples = _scale_samples()
    on_scale = np.zeros(rgb.shape[:2], dtype=bool)
    for row in range(rgb.shape[0]):  # row by row: pixels x samples stays small
        distances = ((rgb[row][:, None, :] - samples[None, :, :]) ** 2).sum(-1)
        on_scale[row] = distances.min(axis=1) <= tolerance ** 2
    return np.where(nan, 1, np.where(on_scale, 2, 0))


def _runs(labels) -> list[tuple[int, int]]:
    """Runs of labelled pixels along a row, unlabelled pixels skipped and runs narrower than a few
    pixels dropped as noise: [(label, width), ...] from left to right."""
    runs: list[list[int]] = []
    for label in (int(v) for v in labels if v):
        if runs and runs[-1][0] == label:
            runs[-1][1] += 1
        else:
            runs.append([label, 1])
    merged: list[list[int]] = []
    for label, width in (r for r in runs if r[1] >= 4):
        if merged and merged[-1][0] == label:
            merged[-1][1] += width
        else:
            merged.append([label, width])
    return [(label, width) for label, width in merged]


NAN, HEALTHY = 1, 2


def turn_rows(png: bytes, min_run: int = MIN_RUN_PX) -> int:
    """How many pixel rows show healthy colours and then, to their right, the NaN colour."""
    count = 0
    for row in _labels(png):
        wide = [label for label, width in _runs(row) if width >= min_run]
        count += any(a == HEALTHY and b == NAN for a, b in zip(wide, wide[1:]))
    return count


def nan_rows(png: bytes) -> int:
    """How many pixel rows hold a wide run of the NaN colour (a non-finite stretch of cells)."""
    return sum(any(label == NAN and width >= MIN_RUN_PX for label, width in _runs(row)) for row in _labels(png))


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory):
    """The quickstart executed as `make demo` does (notebooks/run.py) and its static HTML, as a viewer
    without a widget manager shows it (nbguard's text/html fallback, not the live widget)."""
    import nbformat
    from nbconvert import HTMLExporter
    from traitlets.config import Config

    spec = importlib.util.spec_from_file_location("nbguard_notebook_runner", REPO_ROOT / "notebooks" / "run.py")
    runner = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(runner)
    out = tmp_path_factory.mktemp("demo")
    nb, _seconds, error = runner.execute_notebook(REPO_ROOT / "notebooks" / "00_quickstart.ipynb", out)
    assert error is None, f"the quickstart failed: {error}"
    config = Config()
    config.NbConvertBase.display_data_priority = ["text/html", "image/png", "text/plain"]
    body, _ = HTMLExporter(config=config).from_notebook_node(nbformat.from_dict(nb))
    (out / "00_quickstart.static.html").write_text(body)
    return out


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    if not Path(CHROMIUM).exists():
        pytest.skip(f"no Chromium at {CHROMIUM} (.ci/run installs Debian's chromium)")
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield chromium
        chromium.close()


def _keep(name: str, png: bytes) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / name).write_bytes(png)


def test_dashboard_shows_the_turn_and_the_repaired_run_stays_healthy(quickstart, browser):
    page = browser.new_page(viewport=FIRST_SCREEN)
    page.goto((quickstart / "00_quickstart.static.html").as_uri())
    watches = page.locator(".nbguard-watch")
    assert watches.count() == 2, "the failing run's dashboard and the repaired run's"
    failing = watches.nth(0).locator("img.nbg-heatmap").first.screenshot()
    _keep("quickstart-dashboard-failing.png", watches.nth(0).screenshot())
    assert turn_rows(failing) >= 20, "the failing run's heatmap shows healthy steps, then the NaN steps"

    # the repaired run: healthy colours in every row, no NaN stretch anywhere
    repaired = watches.nth(1).locator("img.nbg-heatmap").first.screenshot()
    _keep("quickstart-dashboard-repaired.png", watches.nth(1).screenshot())
    assert nan_rows(repaired) == 0 and turn_rows(repaired) == 0
    assert nan_rows(failing) >= 20
    page.close()


def test_report_first_screen_shows_the_turn(quickstart, browser):
    page = browser.new_page(viewport=FIRST_SCREEN)
    page.goto((quickstart / "00_quickstart.html").as_uri())
    first_screen = page.screenshot()  # the viewport only: what a reader sees before scrolling
    _keep("quickstart-report-first-screen.png", first_screen)
    assert turn_rows(first_screen, REPORT_MIN_RUN_PX) >= 10, "the report's first screen shows healthy steps turning non-finite"
    page.close()
