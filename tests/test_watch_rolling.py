"""The detectors' rolling median and robust baseline equal statistics.median over the same windows, step by step."""
from __future__ import annotations

import random
import statistics
from collections import deque

import pytest

from nbguard.watcher.reads.rolling import MAD_TO_STD, RobustBaseline, RollingMedian


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


@pytest.mark.parametrize(("window", "level_steps"), [(1, 1), (2, 5), (16, 5), (7, 4)])
def test_robust_baseline_level_and_noise_equal_statistics_median_of_the_same_windows(window, level_steps):
    rng = random.Random(100 * window + level_steps)
    baseline, values = RobustBaseline(window, level_steps), []
    assert baseline.level() is None and not baseline
    with pytest.raises(ValueError, match="empty window"):
        baseline.noise_bound(6.0)  # no change yet: nothing to judge a step's noise by
    for _ in range(300):
        value = rng.choice([rng.gauss(0.0, 2.0), float(rng.randint(-2, 2))])  # ties, and equal changes
        baseline.append(value)
        values.append(value)
        assert len(baseline) == min(len(values), window)
        assert baseline.level() == statistics.median(values[-min(window, level_steps):])
        if len(values) > 1:  # the noise: the median |change| of the last window - 1 changes (at least one)
            changes = [abs(b - a) for a, b in zip(values, values[1:])]
            assert baseline.noise_bound(6.0) == 6.0 * MAD_TO_STD * statistics.median(changes[-max(window - 1, 1):])
