"""A PNG of a watch's per-step series: loss, total gradient norm and loss scale.

Non-finite values cannot be plotted as points, so their steps get a vertical vermillion line
(the same colour as NaN cells in the heatmap), and skipped steps a grey tick along the bottom. A
rewind is a dashed bluish-green line at its step over a shaded span back to the state it restored.
"""
from __future__ import annotations

import io
from typing import Any

import numpy as np

from ..document.palette import LINE_COLOR, NAN_COLOR, REWIND_COLOR, SKIP_COLOR

SERIES = (("loss", "loss", False), ("total_grad_norm", "total grad norm", True), ("loss_scale", "loss scale", True))


def _decode(values, n: int) -> np.ndarray:
    out = np.full(n, np.nan)
    for i, value in enumerate(list(values or [])[:n]):
        try:
            out[i] = float(value) if value is not None else np.nan
        except (TypeError, ValueError):
            pass
    return out


def _present(values) -> bool:
    return any(v is not None for v in values or [])


def nonfinite_caption(label: str, n_bad: int, n_finite: int) -> str:
    """What a series panel says about its non-finite steps ("" when there are none)."""
    if not n_bad:
        return ""
    if not n_finite:
        return f"every {label} recorded is non-finite (NaN/Inf): nothing to plot"
    return f"non-finite at {n_bad} step{'s' if n_bad != 1 else ''} (vermillion lines)"


def rewind_spans(history: dict) -> list[tuple[float, float]]:
    """(the step whose state was restored, the step of the rewind) for each rewind the history records."""
    spans = []
    for entry in history.get("rewinds") or []:
        try:
            spans.append((float(entry["restored_after_step"]), float(entry["step"])))
        except (KeyError, TypeError, ValueError):  # an entry this version cannot place: left out, not guessed
            continue
    return spans


def series_png(history: dict, *, dpi: int = 100) -> bytes | None:
    """The series panel for ``history`` (the document's "history" section), or None when it
    records none of loss / total_grad_norm / loss_scale."""
    fig = series_figure(history, dpi=dpi)
    if fig is None:
        return None
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi, facecolor="white")
    return buffer.getvalue()


def series_figure(history: dict, *, dpi: int = 100):
    """The matplotlib Figure behind :func:`series_png` (None when there is nothing to draw).

    Every word sits outside the plotted area (a panel's note above it, the legend above the first
    panel), so no text covers the line; skipped steps are triangles on each panel's bottom edge,
    drawn over the NaN lines and wider than them, so a skipped NaN step shows both marks.
    """
    if not isinstance(history, dict):
        raise TypeError(f"history must be the document's 'history' section (a dict), got {type(history).__name__}")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    from matplotlib.ticker import NullFormatter

    steps = np.asarray(list(history.get("steps") or []), dtype=float)
    shown = [(key, label, log) for key, label, log in SERIES if _present(history.get(key))]
    if not shown or steps.size == 0:
        return None
    skipped = set(history.get("skipped_steps") or [])
    marks = [s for s in steps if int(s) in skipped]
    rewinds = rewind_spans(history)

    width_in = min(10.0, max(6.0, 4.0 + 0.25 * steps.size))  # a short run is not stretched across the page
    panel_in, note_in, header_in, axis_in, left_in = 1.15, 0.24, 0.34, 0.55, 0.8
    height_in = header_in + len(shown) * (note_in + panel_in) + axis_in
    fig = Figure(figsize=(width_in, height_in), dpi=dpi)
    FigureCanvasAgg(fig)
    axes: list[Any] = []
    for index in range(len(shown)):
        bottom = axis_in + (len(shown) - 1 - index) * (note_in + panel_in)
        rect = (left_in / width_in, bottom / height_in, 1 - (left_in + 0.2) / width_in, panel_in / height_in)
        axes.append(fig.add_axes(rect, sharex=axes[0] if axes else None))
    any_bad = False
    for ax, (key, label, log) in zip(axes, shown):
        raw = list(history.get(key) or [])
        values = _decode(raw, steps.size)
        bad = np.asarray([isinstance(v, str) and v.lower() in ("nan", "inf", "-inf") for v in raw[: steps.size]]
                         + [False] * (steps.size - len(raw[: steps.size])), dtype=bool)
        any_bad = any_bad or bool(bad.any())
        finite = np.isfinite(values)
        positive = values[finite & (values > 0)]
        log = log and positive.size > 1 and positive.max() > 10 * positive.min()  # log only across decades
        if log:
            finite &= values > 0
            ax.set_yscale("log")
        ax.plot(steps, np.where(finite, values, np.nan), color=LINE_COLOR, linewidth=1.1, marker="o",
                markersize=2.5 if steps.size <= 60 else 0)  # gaps at bad steps; a lone finite step still shows
        if log:
            ax.yaxis.set_minor_formatter(NullFormatter())
        for step in steps[bad]:
            ax.axvline(step, color=NAN_COLOR, linewidth=1.5, zorder=3)
        if marks:  # over the NaN lines (zorder), half outside the frame (clip_on=False): never hidden
            ax.plot(marks, [0.0] * len(marks), linestyle="none", marker="^", markersize=7, color=SKIP_COLOR,
                    markeredgecolor="white", markeredgewidth=0.8, clip_on=False, zorder=5,
                    transform=ax.get_xaxis_transform())
        ax.set_ylabel(label, fontsize=8)
        ax.tick_params(which="both", labelsize=7)
        ax.grid(alpha=0.25)
        caption = nonfinite_caption(label, int(bad.sum()), int(finite.sum()))
        if caption and not finite.any():  # an empty axis would read as "nothing happened"
            ax.set_yticks([])
        ax.set_title(caption, loc="left", fontsize=7, color=NAN_COLOR, pad=3)
        for restored, at in rewinds:  # the steps a rewind threw away, and the rewind itself
            ax.axvspan(restored, at, color=REWIND_COLOR, alpha=0.12, linewidth=0)
            ax.axvline(at, color=REWIND_COLOR, linewidth=2.0, linestyle="--", zorder=4)  # dashed: a NaN shows between
    for ax in axes[:-1]:
        ax.tick_params(axis="x", labelbottom=False)
    axes[-1].set_xlabel("optimizer step", fontsize=8)
    handles: list[Any] = []
    if any_bad:
        handles.append(Line2D([], [], color=NAN_COLOR, linewidth=1.5, label="non-finite step (NaN/Inf)"))
    if marks:
        handles.append(Line2D([], [], linestyle="none", marker="^", markersize=7, color=SKIP_COLOR, label="skipped step"))
    if rewinds:
        handles.append(Line2D([], [], color=REWIND_COLOR, linewidth=2.0, linestyle="--", label="rewind"))
        handles.append(Patch(facecolor=REWIND_COLOR, alpha=0.12, label="steps undone"))
    if handles:
        fig.legend(handles=handles, loc="upper right", ncol=len(handles), fontsize=7, frameon=False,
                   bbox_to_anchor=(1 - 0.2 / width_in, 1 - 0.04 / height_in), borderaxespad=0, borderpad=0)
    return fig
