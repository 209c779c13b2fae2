"""A PNG of a watch's per-step series: loss, total gradient norm and loss scale.

Non-finite values cannot be plotted as points, so their steps get a vertical vermillion line
(the same colour as NaN cells in the heatmap), and skipped steps a grey tick along the bottom. A
rewind is a dashed bluish-green line at its step over a shaded span back to the state it restored.
"""
from __future__ import annotations

import io

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
    if not isinstance(history, dict):
        raise TypeError(f"history must be the document's 'history' section (a dict), got {type(history).__name__}")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullFormatter

    steps = np.asarray(list(history.get("steps") or []), dtype=float)
    shown = [(key, label, log) for key, label, log in SERIES if _present(history.get(key))]
    if not shown or steps.size == 0:
        return None
    skipped = set(history.get("skipped_steps") or [])
    fig = Figure(figsize=(10, 1.35 * len(shown) + 0.5), dpi=dpi)
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(shown), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (key, label, log) in zip(axes, shown):
        raw = list(history.get(key) or [])
        values = _decode(raw, steps.size)
        bad = np.asarray([isinstance(v, str) and v.lower() in ("nan", "inf", "-inf") for v in raw[: steps.size]]
                         + [False] * (steps.size - len(raw[: steps.size])), dtype=bool)
        finite = np.isfinite(values)
        positive = values[finite & (values > 0)]
        log = log and positive.size > 1 and positive.max() > 10 * positive.min()  # log only across decades
        if log:
            finite &= values > 0
            ax.set_yscale("log")
        ax.plot(steps, np.where(finite, values, np.nan), color=LINE_COLOR, linewidth=1.1)  # gaps at bad steps
        if log:
            ax.yaxis.set_minor_formatter(NullFormatter())
        for step in steps[bad]:
            ax.axvline(step, color=NAN_COLOR, linewidth=1.5)
        ax.set_ylabel(label, fontsize=8)
        ax.tick_params(which="both", labelsize=7)
        ax.grid(alpha=0.25)
        caption = nonfinite_caption(label, int(bad.sum()), int(finite.sum()))
        if caption and not finite.any():  # an empty axis would read as "nothing happened"
            ax.set_yticks([])
            ax.text(0.5, 0.5, caption, transform=ax.transAxes, fontsize=9, color=NAN_COLOR, ha="center", va="center")
        elif caption:
            ax.text(0.005, 0.92, caption, transform=ax.transAxes, fontsize=7, color=NAN_COLOR, va="top")
    marks = [s for s in steps if int(s) in skipped]
    bottom = axes[-1]
    if marks:
        bottom.plot(marks, [0.02] * len(marks), linestyle="none", marker="|", markersize=9, color=SKIP_COLOR,
                    transform=bottom.get_xaxis_transform(), label="skipped step")
    rewinds = rewind_spans(history)
    for i, (restored, at) in enumerate(rewinds):  # the steps a rewind threw away, and the rewind itself
        for ax in axes:
            ax.axvspan(restored, at, color=REWIND_COLOR, alpha=0.12, linewidth=0)
            ax.axvline(at, color=REWIND_COLOR, linewidth=2.0, linestyle="--",
                       label="rewind (shaded: the steps undone)" if ax is bottom and i == 0 else None)
    if marks or rewinds:
        bottom.legend(loc="upper right", fontsize=7, frameon=False)
    axes[-1].set_xlabel("optimizer step", fontsize=8)
    fig.subplots_adjust(left=0.08, right=0.98, top=0.97, bottom=0.5 / fig.get_figheight() + 0.04, hspace=0.15)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi, facecolor="white")
    return buffer.getvalue()
