"""A dashboard that draws at every step, for tests of what it draws (not of how often)."""
from __future__ import annotations

import itertools

from nbguard.notebook.widgets.dashboard import WatchDashboard


def every_step_dashboard(watch, **kwargs) -> WatchDashboard:
    """Every clock read 100 s after the last and no cost budget: every step draws everything.

    The budgets weigh real drawing time, which a loaded machine can stretch past 100 s x budget (a fresh
    Colab venv's first matplotlib draw took over 4 s in CI); their throttling has its own tests."""
    ticks = itertools.count(0, 100.0)
    kwargs = {"heavy_budget": 0, "light_budget": 0, **kwargs}
    return WatchDashboard(watch, "out-1", clock=lambda: next(ticks), **kwargs).attach()
