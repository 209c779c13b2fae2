"""The median of the last N values, kept sorted as they arrive.

The detectors compare each step with a recent median (of 15 log gradient-norm changes, 256 token counts):
``statistics.median`` over a deque sorts the whole window on every step, inside the user's
training step. Kept sorted, a step costs one binary insertion and one removal.
"""
from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Sequence


class RollingMedian:
    def __init__(self, window: int):
        if window < 1:
            raise ValueError(f"a rolling median needs a window of at least 1 value, got {window}")
        self.window = window
        self._arrived: deque[float] = deque()
        self._sorted: list[float] = []

    def __len__(self) -> int:
        return len(self._arrived)

    def __bool__(self) -> bool:
        return bool(self._arrived)

    def append(self, value: float) -> None:
        if len(self._arrived) == self.window:
            oldest = self._arrived.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, oldest)]
        self._arrived.append(value)
        bisect.insort(self._sorted, value)

    def median(self) -> float:
        """As ``statistics.median`` of the window (the mean of the middle two for an even count)."""
        if not self._sorted:
            raise ValueError("no values yet: the median of an empty window")
        return sorted_median(self._sorted)


def sorted_median(values: Sequence[float]) -> float:
    """``statistics.median`` of values already sorted and not empty, without its checks (it runs in
    the user's training step)."""
    half = len(values) // 2
    return values[half] if len(values) % 2 else (values[half - 1] + values[half]) / 2
