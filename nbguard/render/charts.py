"""The pictures a view names (``Chart.kind``), drawn from the document section it points at."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .heatmap import activations_png, heatmap_png, update_norms_png
from .series import series_png

DRAW: dict[str, Callable[[dict], bytes | None]] = {
    "heatmap": heatmap_png, "updates": update_norms_png, "series": series_png, "activations": activations_png}


def chart_png(kind: str, section: Any) -> bytes | None:
    """The PNG of one chart, or None when its section records nothing to draw."""
    if not isinstance(section, dict):
        return None
    return DRAW[kind](section)
