"""Heatmap PNGs of a watch's history: gradient norms, and activation abs-max against a limit.

Drawn with matplotlib's object API on an Agg canvas (no pyplot, so no global figure state and
nothing that needs a display). Large histories are binned (see :mod:`.grid`) so the picture stays
readable with 200 module groups and thousands of steps. Colours are colour-blind safe: viridis
for values, vermillion for NaN, black for Inf; NaN/Inf and skipped steps also get their own
marker shapes in a track above the map, so no one has to rely on hue alone.
"""
from __future__ import annotations

import io
import math
from typing import Any

import numpy as np

from ..document.grid import decode_grid
from ..document.palette import INF_COLOR, MISSING_COLOR, NAN_COLOR, OVER_COLOR, REWIND_COLOR, SCALE, SKIP_COLOR
from ..document.view import plural
from .grid import Bins, aggregate, column_bins, column_flags, row_bins
from .labels import fit_labels
from .series import rewind_spans

DEFAULT_MAX_ROWS = 48
DEFAULT_MAX_COLS = 400
LABEL_CHARS = 36  # a row label longer than this loses its head, never its layer index or leaf (.labels)
FONT_PT = 8
LABEL_IN_PER_CHAR = 0.064  # an 8 pt DejaVu Sans character: 0.057-0.071 measured on module paths
TICK_IN_PER_CHAR = 0.07
TITLE_IN_PER_CHAR = 0.09  # 10 pt bold
COLUMN_IN, MAP_MIN_IN, MAP_MAX_IN = 0.42, 3.4, 9.0  # a short run: cells ~40 px wide
ROW_IN = 0.19
COLORBAR_IN = 1.25  # the bar, its ticks and its label
LEGEND_ITEM_IN = 1.3


def heatmap_png(
    history: dict,
    *,
    max_rows: int = DEFAULT_MAX_ROWS,
    max_cols: int = DEFAULT_MAX_COLS,
    dpi: int = 100,
    title: str | None = None,
) -> bytes:
    """A PNG of ``history["grad_norm"]`` (groups x steps, log colour scale).

    ``history`` is the document's "history" section. Bins keep their maximum, so a NaN in one
    step of one layer still shows after binning; skipped steps are marked in the track above.
    """
    _check_section(history, "history", "grad_norm")
    return _render(
        history,
        key="grad_norm",
        limit=None,
        max_rows=max_rows,
        max_cols=max_cols,
        dpi=dpi,
        title=title or "Gradient norm per module group",
        colorbar_label="grad norm (log scale)",
    )


def update_norms_png(
    history: dict,
    *,
    max_rows: int = DEFAULT_MAX_ROWS,
    max_cols: int = DEFAULT_MAX_COLS,
    dpi: int = 100,
    title: str | None = None,
) -> bytes | None:
    """A PNG of ``history["update_norm"]``: the optimizer's update relative to the weights
    (||Δw|| / ||w||) per group and step, drawn like :func:`heatmap_png` (log colour scale, skipped
    steps marked). None for a history without update norms (an older document, or a watch that
    could not read them: ``history["update_norm_unavailable"]`` says why)."""
    _check_section(history, "history", "grad_norm")
    if "update_norm" not in history:
        return None
    return _render(
        history,
        key="update_norm",
        limit=None,
        max_rows=max_rows,
        max_cols=max_cols,
        dpi=dpi,
        title=title or "Update norm ||Δw|| / ||w|| per module group",
        colorbar_label="update / weights (log scale)",
    )


def activations_png(
    activations: dict,
    *,
    max_rows: int = DEFAULT_MAX_ROWS,
    max_cols: int = DEFAULT_MAX_COLS,
    dpi: int = 100,
    title: str | None = None,
) -> bytes:
    """A PNG of ``activations["absmax"]`` against ``activations["limit"]`` (65504 for fp16).

    The colour scale ends at the limit; cells above it are drawn in their own colour and the
    limit is marked on the colour bar.
    """
    _check_section(activations, "activations", "absmax")
    limit = activations.get("limit", 65504.0)
    try:
        limit = float(limit)
    except (TypeError, ValueError):
        raise ValueError(f"activations['limit'] must be a number, got {limit!r}") from None
    return _render(
        activations,
        key="absmax",
        limit=limit,
        max_rows=max_rows,
        max_cols=max_cols,
        dpi=dpi,
        title=title or "Activation abs-max per module group",
        colorbar_label=f"abs-max (log scale; limit {limit:g})",
    )


def _check_section(section: Any, name: str, key: str) -> None:
    if not isinstance(section, dict):
        raise TypeError(f"{name} must be the document's {name!r} section (a dict), got {type(section).__name__}")
    for required in ("groups", "steps", key):
        if required not in section:
            raise ValueError(f"{name} section has no {required!r}; expected keys groups, steps, {key}")


def heatmap_figure(section: dict, *, key: str = "grad_norm", limit: float | None = None,
                   max_rows: int = DEFAULT_MAX_ROWS, max_cols: int = DEFAULT_MAX_COLS, dpi: int = 100,
                   title: str = "Gradient norm per module group", colorbar_label: str = "grad norm (log scale)"):
    """The matplotlib Figure behind the PNGs (None for a section with nothing to draw): for the tests, which
    read its label texts and where each text lands."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import LinearSegmentedColormap, LogNorm
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    if max_rows < 1 or max_cols < 1:
        raise ValueError("max_rows and max_cols must be at least 1")
    groups = [str(g) for g in section.get("groups") or []]
    steps = list(section.get("steps") or [])
    if not groups or not steps:
        return None
    values, missing = decode_grid(section.get(key), len(groups), len(steps))
    rows = row_bins(groups, max_rows)
    cols = column_bins(steps, max_cols)
    agg = aggregate(values, missing, rows, cols)
    skipped = column_flags(steps, section.get("skipped_steps") or [], cols)
    rewound = column_flags(steps, [at for _, at in rewind_spans(section)], cols)

    cmap = LinearSegmentedColormap.from_list("nbguard", list(SCALE), N=256)  # the canvas interpolates the same stops
    norm = _log_norm(agg.values, limit, LogNorm)

    rgba = np.empty(agg.values.shape + (4,), dtype=float)
    finite = np.isfinite(agg.values)
    rgba[:] = _rgba(MISSING_COLOR)
    if finite.any():
        rgba[finite] = cmap(norm(np.clip(agg.values[finite], norm.vmin, norm.vmax)))
    over = np.zeros_like(finite)
    if limit is not None:
        over = finite & (agg.values > limit)
        rgba[over] = _rgba(OVER_COLOR)
    rgba[agg.inf] = _rgba(INF_COLOR)
    rgba[agg.nan] = _rgba(NAN_COLOR)  # NaN wins over Inf in a bin: it is the worse news

    handles = [
        Line2D([], [], marker="s", linestyle="none", markersize=7, color=NAN_COLOR, label="NaN  (✕)"),
        Line2D([], [], marker="s", linestyle="none", markersize=7, color=INF_COLOR, label="Inf  (▲)"),
        Patch(facecolor="white", edgecolor=SKIP_COLOR, hatch="////", label="skipped step (■)"),
        Patch(facecolor=MISSING_COLOR, edgecolor="none", label="no data"),
    ]
    if limit is not None:
        handles.insert(2, Line2D([], [], marker="s", linestyle="none", markersize=7, color=OVER_COLOR,
                                 label=f"> limit {limit:g} (●)"))
    if rewound.any():
        handles.append(Line2D([], [], color=REWIND_COLOR, linestyle="--", linewidth=1.4, label="rewind"))
    shape_note = f"{plural(len(groups), 'group')} × {plural(len(steps), 'step')}"
    if rows.merged or cols.merged:
        shape_note += f", shown as {rows.count} × {cols.count} bins (max per bin)"

    # Sizes in inches from what is drawn: the map grows with rows and columns (a short run is not
    # stretched to a page's width, where a notebook would shrink it and its labels), the label margin
    # with the longest label kept, the legend below the map wraps to the figure's width.
    n_rows, n_cols = max(rows.count, 1), max(cols.count, 1)
    labels = fit_labels(rows.labels, LABEL_CHARS)
    # the track's own labels ("non-finite") share the margin with the row labels
    left_in = 0.3 + LABEL_IN_PER_CHAR * max([len("non-finite"), *(len(label) for label in labels)])
    map_w = min(MAP_MAX_IN, max(MAP_MIN_IN, COLUMN_IN * n_cols))
    title_w = 0.2 + TITLE_IN_PER_CHAR * max(len(title), len(shape_note) * 0.75)
    width_in = max(left_in + map_w + COLORBAR_IN, title_w)
    map_w = width_in - left_in - COLORBAR_IN
    legend_cols = max(1, min(len(handles), int((width_in - 0.2) // LEGEND_ITEM_IN)))
    legend_in = 0.22 * math.ceil(len(handles) / legend_cols)
    map_h = max(1.0, ROW_IN * n_rows)
    track_h, header_in, axis_in = 0.42, 0.62, 0.5
    height_in = header_in + track_h + 0.08 + map_h + axis_in + legend_in + 0.1
    fig = Figure(figsize=(width_in, height_in), dpi=dpi)
    FigureCanvasAgg(fig)

    def box(left: float, bottom: float, width: float, height: float) -> tuple[float, float, float, float]:
        return (left / width_in, bottom / height_in, width / width_in, height / height_in)

    map_bottom = legend_in + 0.1 + axis_in
    ax = fig.add_axes(box(left_in, map_bottom, map_w, map_h))
    tax = fig.add_axes(box(left_in, map_bottom + map_h + 0.08, map_w, track_h), sharex=ax)
    cax = fig.add_axes(box(left_in + map_w + 0.15, map_bottom, 0.18, map_h))

    ax.imshow(rgba, aspect="auto", interpolation="nearest", origin="upper",
              extent=(-0.5, n_cols - 0.5, n_rows - 0.5, -0.5))
    _label_rows(ax, labels)
    _label_columns(ax, cols, steps, map_w)
    ax.tick_params(labelsize=FONT_PT, length=2)
    for start, end in _runs(skipped):  # hatch skipped columns over the map as well
        ax.axvspan(start - 0.5, end - 0.5, facecolor="none", edgecolor=SKIP_COLOR, hatch="////", linewidth=0)
    for column in np.flatnonzero(rewound):  # a rewind: the state before it was put back here
        ax.axvline(float(column), color=REWIND_COLOR, linewidth=1.4, linestyle="--")
    ax.set_xlabel("optimizer step", fontsize=FONT_PT)

    # the track: one row for non-finite columns (x = NaN, ^ = Inf, o = over limit), one for skips
    col_nan = agg.nan.any(axis=0) if agg.nan.size else np.zeros(n_cols, bool)
    col_inf = (agg.inf.any(axis=0) & ~col_nan) if agg.inf.size else np.zeros(n_cols, bool)
    col_over = (over.any(axis=0) & ~col_nan & ~col_inf) if over.size else np.zeros(n_cols, bool)
    x = np.arange(cols.count)
    tax.scatter(x[col_nan], np.full(col_nan.sum(), 1.0), marker="x", s=22, color=NAN_COLOR, linewidths=1.4)
    tax.scatter(x[col_inf], np.full(col_inf.sum(), 1.0), marker="^", s=18, color=INF_COLOR)
    tax.scatter(x[col_over], np.full(col_over.sum(), 1.0), marker="o", s=14, color=OVER_COLOR)
    tax.scatter(x[skipped], np.zeros(int(skipped.sum())), marker="s", s=10, color=SKIP_COLOR)
    tax.set_ylim(-0.6, 1.6)
    tax.set_yticks([0, 1], ["skipped", "non-finite"], fontsize=FONT_PT)
    tax.tick_params(axis="x", labelbottom=False, length=0)
    tax.set_xlim(-0.5, n_cols - 0.5)
    for spine in ("top", "right"):
        tax.spines[spine].set_visible(False)

    mappable = ScalarMappable(norm=norm, cmap=cmap)
    cbar = fig.colorbar(mappable, cax=cax)
    cbar.ax.tick_params(labelsize=FONT_PT - 1)
    cbar.set_label(colorbar_label, fontsize=FONT_PT - 1)
    if limit is not None:
        cbar.ax.axhline(limit, color=OVER_COLOR, linewidth=2)

    fig.text(0.1 / width_in, 1 - 0.1 / height_in, title, fontsize=10, weight="bold", va="top")
    fig.text(0.1 / width_in, 1 - 0.36 / height_in, shape_note, fontsize=FONT_PT, va="top")
    fig.legend(handles=handles, loc="lower left", ncol=legend_cols, fontsize=FONT_PT - 0.5, frameon=False,
               bbox_to_anchor=(0.1 / width_in, 0.05 / height_in), handlelength=1.2, columnspacing=1.0,
               borderaxespad=0, borderpad=0)
    return fig


def _render(section: dict, **options: Any) -> bytes:
    fig = heatmap_figure(section, **options)
    if fig is None:
        groups = section.get("groups") or []
        return _placeholder(options["title"], "no steps recorded yet" if groups else "no module groups recorded",
                            options["dpi"])
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=options["dpi"], facecolor="white")
    return buffer.getvalue()


def _placeholder(title: str, message: str, dpi: int) -> bytes:
    """A small picture that says there is nothing to draw yet (a watch before its first step)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 0.9), dpi=dpi)
    FigureCanvasAgg(fig)
    fig.text(0.02, 0.7, title, fontsize=10, weight="bold", va="center")
    fig.text(0.02, 0.3, message, fontsize=9, va="center")
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi, facecolor="white")
    return buffer.getvalue()


def _log_norm(values: np.ndarray, limit: float | None, LogNorm):
    finite = values[np.isfinite(values)]
    positive = finite[finite > 0]
    if positive.size:
        vmin, vmax = float(positive.min()), float(positive.max())
    else:
        vmin, vmax = 1e-6, 1.0
    if limit is not None:
        vmax = limit  # the scale ends at the limit: how close each cell is, not how far past
        vmin = min(vmin, limit / 10)
    if vmax <= vmin:
        vmax = vmin * 10
    return LogNorm(vmin=vmin, vmax=vmax, clip=True)


def _rgba(color: str):
    from matplotlib.colors import to_rgba

    return to_rgba(color)


def _label_rows(ax, labels: list[str]) -> None:
    n = len(labels)
    every = max(1, math.ceil(n / 60))  # at most ~60 labels; rows beyond are already binned
    positions = list(range(0, n, every))
    ax.set_yticks(positions, [labels[i] for i in positions])


def _label_columns(ax, cols: Bins, steps: list, width_in: float) -> None:
    """Step numbers under the map, as many as fit side by side at the tick font (never overlapping)."""
    n = cols.count
    if n == 0:
        ax.set_xticks([])
        return
    widest = max(len(label) for label in cols.labels) + 2  # digits plus a gap
    fit = max(1, int(width_in / (widest * TICK_IN_PER_CHAR)))
    every = max(1, math.ceil(n / fit))
    nice = [1, 2, 5, 10, 20, 25, 50, 100, 200, 250, 500, 1000, 2000, 5000, 10000]
    every = next((v for v in nice if v >= every), every)
    positions = list(range(0, n, every))
    ax.set_xticks(positions, [cols.labels[i] for i in positions])


def _runs(flags: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) runs of True in a 1-D bool array."""
    runs, start = [], None
    for i, flag in enumerate(list(flags) + [False]):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            runs.append((start, i))
            start = None
    return runs
