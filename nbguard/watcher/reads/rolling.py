"""The median of the last N values, kept sorted as they arrive, and the robust baseline the spike
detectors judge a step against.

The detectors compare each step with a recent median (of 15 log gradient-norm changes, 256 token counts):
``statistics.median`` over a deque sorts the whole window on every step, inside the user's
training step. Kept sorted, a step costs one binary insertion and one removal.
"""
from __future__ import annotations

import bisect
import itertools
from collections import deque
from collections.abc import Sequence

# One MAD of a normal sample is 0.6745 standard deviations; scaled, it estimates the std robustly.
MAD_TO_STD = 1.4826


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


class RobustBaseline:
    """A run's last ``window`` healthy values (log norms or ratios): its level and its noise, robustly.

    The level is the median of the last ``level_steps`` values; the noise is the median absolute change
    between consecutive values (a run drifting steadily over decades has small steps, not a wide spread).
    The gradient-norm explosion and update-spike detectors both judge a step by how far it sits above the
    level, against ``noise_bound(z)``. The caller appends only the steps it judged healthy.
    """

    def __init__(self, window: int, level_steps: int):
        self.level_steps = level_steps
        self.recent: deque[float] = deque(maxlen=window)
        # |change| between consecutive values, kept sorted (window 1: one change, never judged before the next)
        self.changes = RollingMedian(max(window - 1, 1))

    def __len__(self) -> int:
        return len(self.recent)

    def __bool__(self) -> bool:
        return bool(self.recent)

    def append(self, value: float) -> None:
        if self.recent:
            self.changes.append(abs(value - self.recent[-1]))
        self.recent.append(value)

    def level(self) -> float | None:
        """The median of the last ``level_steps`` values (None before any)."""
        if not self.recent:
            return None
        return sorted_median(sorted(itertools.islice(reversed(self.recent), self.level_steps)))

    def noise_bound(self, z: float) -> float:
        """``z`` robust standard deviations of the step-to-step changes (ValueError before the first change)."""
        return z * MAD_TO_STD * self.changes.median()
