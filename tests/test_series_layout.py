"""The per-step series PNG read as a person reads it (issue 41): no word over a plotted line, and a skipped
step's mark seen over the NaN line of that same step, on every panel."""
from __future__ import annotations

import io
import itertools

import numpy as np
from matplotlib.image import imread
from matplotlib.text import Text

from nbguard.document.palette import NAN_COLOR, SKIP_COLOR
from nbguard.render.series import series_figure, series_png

HISTORY = {"steps": list(range(8)), "groups": [], "grad_norm": [],
           "loss": [4.8, 4.7, "nan", 4.6, 4.65, "nan", 4.5, 4.4],
           "total_grad_norm": [1.2, 1.4, "inf", 1.3, 1.1, "nan", 1.0, 0.9], "loss_scale": [65536.0] * 8}


def count(png: bytes, hex_color: str) -> int:
    pixels = (imread(io.BytesIO(png))[..., :3] * 255).round().astype(int)
    rgb = [int(hex_color[i:i + 2], 16) for i in (1, 3, 5)]
    return int((np.abs(pixels - rgb).sum(axis=-1) <= 6).sum())


def test_no_word_lands_on_a_panel_or_on_another_word():
    for history in (dict(HISTORY, skipped_steps=[2, 5]), HISTORY, dict(HISTORY, loss=["nan"] * 8)):
        fig = series_figure(history)
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        panels = [ax.get_window_extent(renderer) for ax in fig.axes]
        # the figure's words, the legend's, and each panel's own (titles, notes); tick labels are outside
        words = [*fig.texts, *(t for legend in fig.legends for t in legend.get_texts()),
                 *(c for ax in fig.axes for c in ax.get_children() if isinstance(c, Text))]
        boxes = [(w.get_text(), w.get_window_extent(renderer)) for w in words if w.get_visible() and w.get_text()]
        assert any("non-finite at 2 steps" in text for text, _ in boxes)
        for (text, box), panel in itertools.product(boxes, panels):
            assert not box.overlaps(panel), text
        for (a, box_a), (b, box_b) in itertools.combinations(boxes, 2):
            assert not box_a.overlaps(box_b), (a, b)
        for _, box in boxes:
            assert fig.bbox.x0 - 1 <= box.x0 and box.x1 <= fig.bbox.x1 + 1 and box.y1 <= fig.bbox.y1 + 1


def test_a_skipped_nan_step_shows_its_skip_mark_on_every_panel():
    skipped = dict(HISTORY, skipped_steps=[2, 5])
    fig = series_figure(skipped)
    for ax in fig.axes:
        nan_lines = [line for line in ax.get_lines() if line.get_color() == NAN_COLOR]
        [marks] = [line for line in ax.get_lines() if line.get_marker() == "^"]
        assert list(marks.get_xdata()) == [2, 5]
        assert all(marks.get_zorder() > line.get_zorder() for line in nan_lines)
        assert marks.get_markersize() > 3 * max((line.get_linewidth() for line in nan_lines), default=0)
    # on the picture: the marks add grey wider than a line, on each of the three panels
    assert count(series_png(skipped), SKIP_COLOR) - count(series_png(HISTORY), SKIP_COLOR) > 3 * 2 * 12


def test_the_dashboard_sparkline_draws_a_skipped_nan_steps_mark_over_its_nan_line():
    import xml.etree.ElementTree as ET

    from nbguard.notebook.widgets.sparkline import sparkline_svg

    svg = ET.fromstring(sparkline_svg([1.0, 2.0, float("nan"), 1.5], skipped=[False, False, True, False]))
    shapes = list(svg)
    [nan_line] = [el for el in shapes if el.tag.endswith("line") and el.get("stroke") == NAN_COLOR]
    [mark] = [el for el in shapes if el.get("fill") == SKIP_COLOR]
    assert shapes.index(mark) > shapes.index(nan_line)  # painted after, so on top
    xs = [float(point.split(",")[0]) for point in mark.get("points").split()]
    assert min(xs) < float(nan_line.get("x1")) < max(xs)  # centred on the NaN step
    assert max(xs) - min(xs) >= 3 * float(nan_line.get("stroke-width"))  # wider than the line it sits on
