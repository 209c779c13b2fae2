"""Showing results in the notebook: the widget when ipywidgets is usable and a front end is connected,
else the static bundle.

Headless (nbclient: ``nbconvert --execute``, papermill, ``notebooks/run.py``) no widget is shown: nobody
would see or click it, and its saved view would win over the static HTML in ``nbconvert --to html``,
which then draws an empty box wherever the widget JavaScript cannot load.

Each ``show_*`` emits ONE output (see :mod:`.display`) and keeps the views it opened in
``OPEN_VIEWS`` so ``%unload_ext nbguard`` can close them.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from .display import NO_WIDGETS_HINT, publish, republish, with_output_id
from .frontend import front_end_connected

OPEN_VIEWS: list[Any] = []


def widgets_available() -> bool:
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        return False
    return True


def widgets_shown() -> bool:
    """Widgets where someone can see them; headless the static bundle alone (and no hint: nothing is missing)."""
    return front_end_connected() and widgets_available()


def _static_hint() -> str | None:
    return NO_WIDGETS_HINT if front_end_connected() else None


def show_audit(result, *, names: dict[str, str], rerun: Callable[[], Any],
               apply: Callable[[str], tuple[Any, str]]):
    """The audit as finding cards (or the static bundle); returns the view or None."""
    doc = with_output_id(result.to_document(names=names))
    if not widgets_shown():
        publish(doc, hint=_static_hint())
        return None
    from .widgets.cards import FindingsView

    holder: dict[str, Any] = {}

    def refresh_static(new_result) -> None:
        # the saved notebook keeps the re-audited view, under the same output_id
        republish(holder.get("handle"), with_output_id(new_result.to_document(names=names), doc["output_id"]), view.widget)

    view = FindingsView(result, doc["output_id"], rerun=rerun, apply=apply, names=names, on_change=refresh_static)
    holder["handle"] = publish(doc, view.widget)
    OPEN_VIEWS.append(view)
    return view


def show_diagnosis(diagnosis, *, names: dict[str, str], apply: Callable[[str], tuple[Any, str]] | None):
    doc = with_output_id(diagnosis.to_document(names=names))
    if not widgets_shown():
        publish(doc, hint=_static_hint())
        return None
    from .widgets.cards import DiagnosisView

    view = DiagnosisView(doc, doc["output_id"], apply)
    publish(doc, view.widget)
    OPEN_VIEWS.append(view)
    return view


class LiveWatch:
    """A watch's output: the live dashboard plus a static copy refreshed when the run ends.

    Holds its watch weakly: while attached, the model's hooks keep the watch alive; once the user
    deletes the model, this output keeps only its last document.
    """

    def __init__(self, watch):
        self._watch = weakref.ref(watch)
        self.handle = None
        self.doc = with_output_id(watch.to_document())
        self.dashboard = None
        shown = widgets_shown()
        self.hint = None if shown else _static_hint()  # checked once: a refresh may run outside the cell
        if shown:
            from .widgets.dashboard import WatchDashboard

            self.dashboard = WatchDashboard(watch, self.doc["output_id"], on_new_events=self.refresh_static).attach()
            OPEN_VIEWS.append(self)
        self.handle = publish(self.doc, self.widget, self.hint)

    @property
    def watch(self):
        """The watch while it is alive, else None."""
        return self._watch()

    def summary(self) -> str:
        """The line a ``%%nanwatch`` cell prints under this output when it ends: only what the view does not show
        (that the watch detached, the policy it ran under); its steps, skips and events are the view's own."""
        watch = self.watch
        if watch is None:
            return "nbguard watch: ended (its model was deleted)"
        if getattr(watch, "no_rank_attached", False):  # (ranks.RankWatches) the view has nothing to show
            return watch.summary()
        policy = getattr(watch, "policy", None)
        return ("nbguard: the watch detached when the cell ended" + (f" (policy {policy})" if policy else "")
                + "; its steps and events are in the view above")

    @property
    def widget(self):
        return self.dashboard.widget if self.dashboard is not None else None

    def refresh_static(self) -> None:
        """Bring the static copy of this output (text/HTML/JSON) up to date, in place."""
        watch = self.watch
        if watch is not None:
            self.doc = with_output_id(watch.to_document(), self.doc["output_id"])
        republish(self.handle, self.doc, self.widget, self.hint)

    def finish(self) -> None:
        """Final drawing, and the static copy of the output brought up to date."""
        if self.dashboard is not None:
            self.dashboard.finish()
        self.refresh_static()

    def close(self) -> None:
        if self.dashboard is not None:
            self.dashboard.close()


def close_all() -> None:
    while OPEN_VIEWS:
        view = OPEN_VIEWS.pop()
        closer = getattr(view, "close", None)
        if closer is not None:
            closer()
        elif hasattr(view, "widget"):
            view.widget.close()
