"""Inline SVG sparklines: a few hundred bytes, drawn in microseconds, no matplotlib.

Non-finite values are marked by a vermillion line across the height and skipped steps by a grey
triangle on the bottom edge, wider than that line and drawn over it, so a NaN cannot hide in a gap
of the line and a skipped NaN step shows both.
"""
from __future__ import annotations

import html
import math
from collections.abc import Sequence
from typing import Any

from ...document.palette import LINE_COLOR, NAN_COLOR, SKIP_COLOR


def _value(v: Any) -> float | None:
    if v is None:
        return None
    try:
        return float(v)  # "nan"/"inf" strings of the document decode here too
    except (TypeError, ValueError):
        return None


def sparkline_svg(values: Sequence[Any], *, width: int = 240, height: int = 40, log: bool = False,
                  skipped: Sequence[bool] | None = None, label: str = "") -> str:
    vals = [_value(v) for v in values]
    n = len(vals)
    drawn = _envelope(vals, width, log)  # at most ~2 points per pixel column: cheap for long runs
    finite = [v for v in vals if v is not None and math.isfinite(v) and (v > 0 or not log)]
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" role="img" aria-label="{html.escape(str(label), quote=True)}">']
    if n and finite:
        tr = (lambda v: math.log10(v)) if log else (lambda v: v)
        lo, hi = min(map(tr, finite)), max(map(tr, finite))
        span = (hi - lo) or 1.0
        x = (lambda i: 2 + (width - 4) * (i / max(n - 1, 1)))
        y = (lambda v: height - 3 - (height - 6) * ((tr(v) - lo) / span))
        points, segments = [], []
        for i in drawn:
            v = vals[i]
            if v is not None and math.isfinite(v) and (v > 0 or not log):
                points.append(f"{x(i):.1f},{y(v):.1f}")
            elif points:
                segments.append(points)
                points = []
        if points:
            segments.append(points)
        for seg in segments:
            if len(seg) == 1:
                cx, cy = seg[0].split(",")
                parts.append(f'<circle cx="{cx}" cy="{cy}" r="1.5" fill="{LINE_COLOR}"/>')
            else:
                parts.append(f'<polyline fill="none" stroke="{LINE_COLOR}" stroke-width="1.3" points="{" ".join(seg)}"/>')
    column = (lambda i: round(2 + (width - 4) * (i / max(n - 1, 1))))
    for xi in sorted({column(i) for i, v in enumerate(vals) if v is not None and not math.isfinite(v)}):
        parts.append(f'<line x1="{xi}" x2="{xi}" y1="0" y2="{height}" stroke="{NAN_COLOR}" stroke-width="2"/>')
    for xi in sorted({column(i) for i, k in enumerate(skipped or ()) if k}):
        # a triangle wider than the NaN line, drawn after it: a skipped NaN step shows both marks
        parts.append(f'<polygon class="skip" points="{xi - 4},{height} {xi + 4},{height} {xi},{height - 7}" '
                     f'fill="{SKIP_COLOR}" stroke="white" stroke-width="0.8"/>')
    parts.append("</svg>")
    return "".join(parts)


def _envelope(vals: list, width: int, log: bool) -> list[int]:
    """Indices to draw: all of them when they fit, else each pixel column's min and max
    (and its first non-finite point, so the line breaks where the run broke)."""
    n = len(vals)
    if n <= width:
        return list(range(n))
    keep: list[int] = []
    per = n / width
    for col in range(width):
        lo, hi = int(col * per), min(int((col + 1) * per), n)
        good = [i for i in range(lo, hi) if vals[i] is not None and math.isfinite(vals[i]) and (vals[i] > 0 or not log)]
        bad = [i for i in range(lo, hi) if vals[i] is None or not math.isfinite(vals[i])]
        picks = set(bad[:1])
        if good:
            picks.update((min(good, key=vals.__getitem__), max(good, key=vals.__getitem__)))
        keep.extend(sorted(picks))
    return keep


def last_value(values: Sequence[Any]) -> str:
    for v in reversed(values):
        if v is not None:
            f = _value(v)
            if f is None:
                return str(v)
            return f"{f:.4g}" if math.isfinite(f) else str(f)
    return "–"
