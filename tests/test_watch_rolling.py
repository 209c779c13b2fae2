"""The detectors' rolling median equals statistics.median over the same window, step by step."""
from __future__ import annotations

import random
import statistics
from collections import deque

import pytest

from nbguard.watcher.rolling import RollingMedian


@pytest.mark.parametrize("window", [1, 2, 5, 16])
def test_rolling_median_matches_the_median_of_the_last_window_values(window):
    rng = random.Random(window)
    rolling, recent = RollingMedian(window), deque(maxlen=window)
    for _ in range(200):
        value = rng.choice([rng.random(), float(rng.randint(0, 3))])  # ties too: evicting one must keep the other
        rolling.append(value)
        recent.append(value)
        assert len(rolling) == len(recent)
        assert rolling.median() == statistics.median(recent)


def test_an_empty_window_has_no_median_and_a_window_holds_at_least_one_value():
    assert not RollingMedian(4)
    with pytest.raises(ValueError, match="empty window"):
        RollingMedian(4).median()
    with pytest.raises(ValueError, match="at least 1 value, got 0"):
        RollingMedian(0)
