"""Group x step grids from a document, and their aggregation for display.

A history with 200 module groups and thousands of steps cannot be drawn cell by cell, so rows
and columns are merged into bins. A bin keeps the worst thing in it: NaN beats Inf beats the
largest finite value, so one bad cell among thousands stays visible.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass
class Bins:
    """Contiguous bins over an axis: ``starts[i]`` is the first index of bin i."""

    starts: list[int]
    labels: list[str]
    size: int  # the number of original items

    @property
    def count(self) -> int:
        return len(self.starts)

    @property
    def merged(self) -> bool:
        return self.count < self.size


def column_bins(steps: list, max_cols: int) -> Bins:
    """Equal-width step bins (at most ``max_cols``), labelled by their first step."""
    n = len(steps)
    width = max(1, math.ceil(n / max(1, max_cols)))
    starts = list(range(0, n, width))
    return Bins(starts=starts, labels=[str(steps[s]) for s in starts], size=n)


def row_bins(groups: list[str], max_rows: int) -> Bins:
    """Bins over module groups, at most ``max_rows``.

    First try merging by a shared name prefix (``model.layers.3.*`` into ``model.layers.3``) at
    the deepest level that fits, so rows stay meaningful blocks; if that leaves too few rows,
    merge runs of equal length labelled with their range (``model.layers.0–4``).
    """
    n = len(groups)
    if n <= max_rows:
        return Bins(starts=list(range(n)), labels=list(groups), size=n)
    parts = [g.split(".") for g in groups]
    deepest = max(len(p) for p in parts)
    for depth in range(deepest - 1, 0, -1):
        keys = [".".join(p[:depth]) for p in parts]
        starts = [i for i in range(n) if i == 0 or keys[i] != keys[i - 1]]
        if len(starts) <= max_rows:
            if len(starts) >= max(2, max_rows // 4):
                labels = []
                for b, start in enumerate(starts):
                    end = starts[b + 1] if b + 1 < len(starts) else n
                    labels.append(keys[start] + (f" ({end - start})" if end - start > 1 else ""))
                return Bins(starts=starts, labels=labels, size=n)
            break
    width = math.ceil(n / max_rows)
    starts = list(range(0, n, width))
    labels = [range_label(groups[s], groups[min(s + width, n) - 1]) for s in starts]
    return Bins(starts=starts, labels=labels, size=n)


def range_label(first: str, last: str) -> str:
    """A short name for the run of groups from ``first`` to ``last``: ``model.layers.0–4``."""
    if first == last:
        return first
    a, b = first.split("."), last.split(".")
    common = 0
    while common < min(len(a), len(b)) and a[common] == b[common]:
        common += 1
    if common < len(a) and common < len(b):
        return ".".join(a[:common] + [f"{a[common]}–{b[common]}"])
    return f"{first} … {last}"


@dataclass
class Aggregate:
    """A binned grid: finite maxima plus where NaN, Inf, over-limit and missing cells are."""

    values: np.ndarray  # max finite value per bin (nan where none)
    nan: np.ndarray
    inf: np.ndarray
    missing: np.ndarray  # no data at all in the bin


def aggregate(values: np.ndarray, missing: np.ndarray, rows: Bins, cols: Bins) -> Aggregate:
    """Reduce (values, missing) over row and column bins, keeping the worst cell of each bin."""
    if values.size == 0:
        empty = np.zeros((rows.count, cols.count), dtype=bool)
        return Aggregate(np.full(empty.shape, np.nan), empty, empty.copy(), ~empty)
    present = ~missing
    nan = np.isnan(values) & present
    inf = np.isinf(values) & present
    finite = np.where(np.isfinite(values) & present, values, -np.inf)

    def reduce(a: np.ndarray) -> np.ndarray:
        if rows.merged:
            a = np.maximum.reduceat(a, rows.starts, axis=0)
        if cols.merged:
            a = np.maximum.reduceat(a, cols.starts, axis=1)
        return a

    best = reduce(finite)
    best = np.where(np.isneginf(best), np.nan, best)
    return Aggregate(values=best, nan=reduce(nan), inf=reduce(inf), missing=~reduce(present))


def column_flags(steps: list, flagged: list, cols: Bins) -> np.ndarray:
    """Per column bin: does it contain any of the ``flagged`` steps (e.g. skipped steps)?"""
    flagged_set = set(flagged or [])
    hits = np.asarray([s in flagged_set for s in steps], dtype=bool)
    if hits.size == 0:
        return np.zeros(cols.count, dtype=bool)
    return np.maximum.reduceat(hits, cols.starts) if cols.merged else hits
