"""The one colour definition of nbguard: severities, NaN/Inf/over-limit/skipped/missing cells and the
value scale of heatmaps.

matplotlib (``nbguard.render.heatmap``, ``series``), the static HTML and the JupyterLab canvas all
draw from this table: the view carries it (``view(doc).palette``), so the canvas never keeps a copy.
Okabe-Ito colours are colour-blind safe; every state is also spelled out or marked by shape.
"""
from __future__ import annotations

from typing import Any

NAN_COLOR = "#D55E00"  # Okabe-Ito vermillion: the worst news
INF_COLOR = "#000000"
OVER_COLOR = "#CC79A7"  # Okabe-Ito reddish purple: finite but above the fp16 limit
MISSING_COLOR = "#D9D9D9"
SKIP_COLOR = "#7F7F7F"
LINE_COLOR = "#0072B2"  # series lines
GOOD_COLOR = "#1A7F37"  # a finding gone after a fix, a verified fix
REWIND_COLOR = "#009E73"  # Okabe-Ito bluish green: a rewind, and the steps it undid
SEVERITY_COLORS = {"error": "#D55E00", "warning": "#E69F00", "info": "#0072B2"}
# viridis from 0.12 to 1.0 in nine stops: its near-black end is dropped so Inf (black) stands apart.
SCALE = ("#472a7a", "#3e4c8a", "#306a8e", "#25848e", "#1f9f88", "#37b878", "#6ece58", "#b5de2b", "#fde725")


def palette() -> dict[str, Any]:
    """The palette as data, as the view and the Lab canvas read it."""
    return {
        "nan": NAN_COLOR, "inf": INF_COLOR, "over": OVER_COLOR, "missing": MISSING_COLOR, "skipped": SKIP_COLOR,
        "line": LINE_COLOR, "good": GOOD_COLOR, "rewind": REWIND_COLOR, "severity": dict(SEVERITY_COLORS), "scale": list(SCALE),
    }
