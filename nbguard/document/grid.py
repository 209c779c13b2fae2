"""Reading the group x step grids of a watch history (grad norms, activation abs-max).

Cells may be numbers, "nan"/"inf"/"-inf" or null (missing); short or ragged rows are padded as
missing, so a history still being written renders.
"""
from __future__ import annotations

import numpy as np

from .codec import MAX_GRID_CELLS, DocumentLimitError


def decode_grid(grid, n_rows: int, n_cols: int) -> tuple[np.ndarray, np.ndarray]:
    """(values, missing) arrays of shape (n_rows, n_cols) from a JSON grid.

    Cells may be numbers, "nan"/"inf"/"-inf" or null (missing); short or ragged rows are padded
    as missing, so a history still being written renders. A grid of more than MAX_GRID_CELLS
    cells is refused (:class:`DocumentLimitError`) before anything is allocated: the shape comes
    from the group and step lists, so a few bytes of names could otherwise ask for gigabytes.
    """
    if n_rows * n_cols > MAX_GRID_CELLS:
        raise DocumentLimitError(f"a history grid of {n_rows} groups x {n_cols} steps = {n_rows * n_cols} cells is "
                                 f"over the limit of {MAX_GRID_CELLS} cells (MAX_GRID_CELLS)")
    values = np.full((n_rows, n_cols), np.nan, dtype=np.float64)
    missing = np.ones((n_rows, n_cols), dtype=bool)
    if grid is None or n_rows == 0 or n_cols == 0:
        return values, missing
    if isinstance(grid, np.ndarray):
        block = np.asarray(grid, dtype=np.float64)[:n_rows, :n_cols]
        values[: block.shape[0], : block.shape[1]] = block
        missing[: block.shape[0], : block.shape[1]] = False
        return values, missing
    for r, row in enumerate(list(grid[:n_rows]) if isinstance(grid, (list, tuple)) else list(grid)[:n_rows]):
        if not isinstance(row, (list, tuple)):
            continue
        row = list(row[:n_cols])
        is_none = [cell is None for cell in row]
        try:
            decoded = np.asarray(row, dtype=np.float64)  # parses "nan"/"inf"; None -> nan
        except (TypeError, ValueError):  # an odd cell: unreadable ones count as missing
            cells = [_cell(cell) for cell in row]
            decoded = np.asarray([np.nan if c is None else c for c in cells], dtype=np.float64)
            is_none = [c is None for c in cells]
        values[r, : len(row)] = decoded
        missing[r, : len(row)] = np.asarray(is_none, dtype=bool)
    return values, missing


def _cell(cell) -> float | None:
    try:
        return float(cell)
    except (TypeError, ValueError):
        return None
