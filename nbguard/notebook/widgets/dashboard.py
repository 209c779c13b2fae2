"""The live dashboard of a NanWatch: heatmaps, sparklines, events, layer and step-range pickers.

The update path is built for training loops: the watch calls :meth:`WatchDashboard.on_watch`
after every optimizer step with host-side scalars it already has; the dashboard appends them and
nothing else (no tensor is touched, so no host sync). Drawing happens on a time throttle:
cheap parts (status line, SVG sparklines, events) at least ``light_interval`` apart, the heatmap
PNGs (grad norm; activation abs-max when the watch probes them) at least ``heavy_interval`` apart,
and each part only once the time since its last drawing is ``1/budget`` times what that drawing
cost: the sparklines take at most ``light_budget`` (1 %) and the heatmaps at most ``heavy_budget``
(2 %) of the run's wall time, however long the history grows (typically far less: a few ms every
half second, a heatmap every few seconds).
"""
from __future__ import annotations

import math
import sys
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import ipywidgets as W

from ...document.outward import outward, say
from ...document.view import event_card
from ...render import activations_png, heatmap_png
from ...render.html import card_html, styled
from .html import esc
from .sparkline import last_value, sparkline_svg


def slice_history(history: dict, lo: int | None, hi: int | None, key: str = "grad_norm") -> dict:
    """The history section restricted to steps in ``[lo, hi]`` (both optional).

    ``key`` names the groups x steps matrix: "grad_norm" (history) or "absmax" (activations).
    """
    steps = history.get("steps", [])
    keep = [i for i, s in enumerate(steps) if (lo is None or s >= lo) and (hi is None or s <= hi)]
    if len(keep) == len(steps):
        return history
    out = dict(history)
    out["steps"] = [steps[i] for i in keep]
    out[key] = [[row[i] for i in keep] for row in history.get(key, [])]
    if key != "grad_norm":
        return out
    for key in ("loss", "total_grad_norm", "loss_scale"):
        if key in history and len(history[key]) == len(steps):
            out[key] = [history[key][i] for i in keep]
    out["skipped_steps"] = [s for s in history.get("skipped_steps", []) if (lo is None or s >= lo) and (hi is None or s <= hi)]
    return out


# TRL's own metrics, drawn beside loss and grad norm when the watched trainer logs them (GRPO/RLOO: the
# reward; DPO/KTO: the reward margin). Read from the trainer's log history at drawing time: nothing per step.
LOGGED_SERIES = ("reward", "rewards/margins")


def logged_series(trainer: Any, lo: int, hi: int) -> list[tuple[str, list[Any]]]:
    """(metric, values) for each of ``LOGGED_SERIES`` the trainer logged for optimizer steps in ``[lo, hi]``.

    A log at ``state.global_step`` g covers the watch's optimizer step g - 1 (the watch counts from 0).
    """
    history = getattr(getattr(trainer, "state", None), "log_history", None) or []
    rows = [h for h in history if isinstance(h, dict) and isinstance(h.get("step"), int) and lo <= h["step"] - 1 <= hi]
    return [(name, [h[name] for h in rows if name in h]) for name in LOGGED_SERIES
            if any(name in h for h in rows)]


def _event_dict(event: Any) -> dict:
    # redacted here: the card shown live is as shareable (screenshots, saved widget state) as a report
    return outward(event.to_dict() if hasattr(event, "to_dict") else dict(event))


class WatchDashboard:
    def __init__(self, watch, output_id: str = "", *, light_interval: float = 0.5, heavy_interval: float = 2.0,
                 heavy_budget: float = 0.02, light_budget: float = 0.01, window: int = 2048, clock: Callable[[], float] = time.monotonic,
                 on_new_events: Callable[[], None] | None = None):
        # the watch weakly (a dashboard outlives its run; it must not keep a deleted model alive),
        # its histories strongly: they are plain data, and all a finished dashboard draws from
        self._watch, self.output_id = weakref.ref(watch), output_id
        self._grad_history = watch.history
        self._activation_history = getattr(watch, "activation_history", None)
        self.on_new_events = on_new_events  # e.g. refresh the static copy so a saved notebook shows the event
        self._events_announced = 0
        self.light_interval, self.heavy_interval = light_interval, heavy_interval
        self.light_budget, self.heavy_budget = light_budget, heavy_budget
        self.clock = clock
        # host scalars appended by the listener, one entry per optimizer step
        self.steps: deque[int] = deque(maxlen=window)
        self.loss: deque[Any] = deque(maxlen=window)
        self.grad_norm: deque[Any] = deque(maxlen=window)
        self.loss_scale: deque[Any] = deque(maxlen=window)
        self.skipped: deque[bool] = deque(maxlen=window)
        self.events: list[dict] = []
        self.renders = {"light": 0, "heavy": 0}
        self.errors: list[str] = []
        self._last_light = self._last_heavy = -math.inf
        self._heavy_cost = self._light_cost = 0.0
        self._history: dict | None = None
        self._following = True  # the step range follows new steps until the user moves it

        self.status = W.HTML(value="<b>nbguard watch</b>: waiting for the first optimizer step…")
        self.heatmap = W.Image(format="png", layout=W.Layout(max_width="100%"))
        # activation abs-max against the fp16 limit: only for a watch started with activations=True
        self._activations: dict | None = None
        self.activations_heatmap = W.Image(format="png", layout=W.Layout(max_width="100%"))
        if getattr(watch, "activation_history", None) is None:
            self.activations_heatmap.layout.display = "none"
        self.sparks = W.HTML()
        self.step_range = W.IntRangeSlider(value=(0, 0), min=0, max=0, description="Steps",
                                           continuous_update=False, layout=W.Layout(width="95%"))
        self.layer = W.Dropdown(options=[], description="Layer")
        self.layer_view = W.HTML()
        self.event_list = W.Select(options=[], description="Events", rows=5, layout=W.Layout(width="95%"))
        self.event_view = W.HTML(value="<em>no events</em>")
        self.step_range.observe(self._on_range, names="value")
        self.layer.observe(lambda _c: self.render_layer(), names="value")
        self.event_list.observe(lambda _c: self.render_event(), names="value")
        self.widget = W.VBox([
            self.status, self.heatmap, self.activations_heatmap, self.sparks, self.step_range,
            W.HBox([W.VBox([self.layer, self.layer_view]), W.VBox([self.event_list, self.event_view])]),
        ])
        self.attached = False
        # import the renderer now, not on the first training step: a first draw that pays for
        # importing matplotlib would look expensive and push every later draw far apart
    # -- wiring to the watch --------------------------------------------------------------------
    @property
    def watch(self):
        """The watch while it is alive, else None."""
        return self._watch()

    def attach(self) -> WatchDashboard:
        if not self.attached and self.watch is not None:
            self.watch.add_listener(self.on_watch)
            self.attached = True
        return self

    def detach(self) -> None:
        if self.attached:
            watch = self.watch
            try:
                if watch is not None:
                    watch.remove_listener(self.on_watch)
            except (KeyError, ValueError):
                pass
            self.attached = False

    def on_watch(self, watch, kind: str, payload: Any) -> None:
        """The watch listener: append host scalars; draw only when the throttle allows. Never raises."""
        try:
            if kind == "step":
                self._append(payload)
            elif kind == "event":
                self.events.append(_event_dict(payload))
            self.maybe_render()
        except Exception as err:  # the dashboard must never break or detach the user's watch
            self.errors.append(f"{type(err).__name__}: {err}")
            if len(self.errors) == 1:
                say(f"nbguard: dashboard update failed ({self.errors[0]}); training goes on", file=sys.stderr)

    def _append(self, payload: dict) -> None:
        if payload.get("rank", 0) != 0:
            return  # a multi-rank run: the series follow rank 0; every rank has its row (_rank_rows)
        self.steps.append(int(payload.get("step", len(self.steps))))
        self.loss.append(payload.get("loss"))
        self.grad_norm.append(payload.get("total_grad_norm", payload.get("grad_norm")))
        self.loss_scale.append(payload.get("loss_scale"))
        self.skipped.append(bool(payload.get("skipped", False)))

    def maybe_render(self) -> None:
        now = self.clock()
        light_wait = max(self.light_interval, self._light_cost / self.light_budget if self.light_budget else 0.0)
        if now - self._last_light >= light_wait:
            started = time.perf_counter()
            self.render_light()
            self._light_cost = time.perf_counter() - started
            self._last_light = now
        wait = max(self.heavy_interval, self._heavy_cost / self.heavy_budget if self.heavy_budget else 0.0)
        if now - self._last_heavy >= wait:
            started = time.perf_counter()
            self.render_heavy()
            if self.on_new_events is not None and len(self.events) > self._events_announced:
                self._events_announced = len(self.events)
                self.on_new_events()  # inside the timed part: its cost counts against the budget
            self._heavy_cost = time.perf_counter() - started
            self._last_heavy = self.clock()

    def finish(self) -> None:
        """Draw everything once more (the run ended) and stop listening."""
        self.detach()
        self.render_light()
        self.render_heavy()

    def close(self) -> None:
        self.detach()
        self.widget.close()

    # -- drawing --------------------------------------------------------------------------------
    def render_light(self) -> None:
        self.renders["light"] += 1
        n = len(self.steps)
        last = self.steps[-1] if n else None
        state = "" if self.attached else " (finished)"
        self.status.value = (
            f"<b>nbguard watch</b>{esc(state)}: step {esc(last if last is not None else '–')} · "
            f"loss {esc(last_value(self.loss))} · grad norm {esc(last_value(self.grad_norm))} · "
            f"loss scale {esc(last_value(self.loss_scale))} · skipped {sum(self.skipped)} · "
            f"events <b>{len(self.events)}</b>"
        ) + self._rank_rows()
        lo, hi = self._range()
        keep = [i for i, s in enumerate(self.steps) if lo <= s <= hi]
        keep_set = set(keep)
        pick = (lambda seq: [item for i, item in enumerate(seq) if i in keep_set])
        skipped = pick(self.skipped)
        # (name, values, log scale, skipped-step marks: None for the trainer's logged series)
        rows: list[tuple[str, list[Any], bool, list[bool] | None]] = [
            ("loss", pick(self.loss), False, skipped), ("grad norm", pick(self.grad_norm), True, skipped)]
        if any(v is not None for v in self.loss_scale):
            rows.append(("loss scale", pick(self.loss_scale), True, skipped))
        watch = self.watch
        if watch is not None and getattr(watch, "trainer", None) is not None:
            rows += [(name, vals, False, None) for name, vals in logged_series(watch.trainer, lo, hi)]
        self.sparks.value = "".join(
            f'<div style="display:inline-block;margin-right:14px"><small>{esc(name)} (last {esc(last_value(vals))})</small><br>'
            f"{sparkline_svg(vals, log=log, skipped=marks, label=name)}</div>"
            for name, vals, log, marks in rows
        )
        if len(self.event_list.options) != len(self.events):
            self.event_list.options = [(self._event_label(e), i) for i, e in enumerate(self.events)]
            if self.event_list.value is None and self.events:
                self.event_list.value = 0
        self._update_range_bounds()

    def render_heavy(self) -> None:
        self.renders["heavy"] += 1
        self._history = self._grad_history.to_dict()
        groups = self._history.get("groups", [])
        if list(self.layer.options) != groups:
            current = self.layer.value
            self.layer.options = groups
            if current in groups:
                self.layer.value = current
        lo, hi = self._range()
        section = slice_history(self._history, lo, hi)
        if section.get("steps"):
            self.heatmap.value = heatmap_png(section)
        acts = self._activation_history
        if acts is not None:
            self._activations = acts.to_dict()
            self._draw_activations(lo, hi)
        self.render_layer()

    def _draw_activations(self, lo: int, hi: int) -> None:
        if self._activations is None:
            return
        section = slice_history(self._activations, lo, hi, key="absmax")
        if section.get("steps") and section.get("groups"):
            self.activations_heatmap.value = activations_png(section)

    def render_layer(self) -> None:
        history, group = self._history, self.layer.value
        if not history or group is None or group not in history.get("groups", []):
            self.layer_view.value = ""
            return
        lo, hi = self._range()
        section = slice_history(history, lo, hi)
        row = section["grad_norm"][section["groups"].index(group)]
        skipped = set(section.get("skipped_steps", []))
        self.layer_view.value = (
            f"<small>grad norm of <code>{esc(group)}</code>, steps {esc(lo)}–{esc(hi)}, "
            f"last {esc(last_value(row))}</small><br>"
            + sparkline_svg(row, log=True, skipped=[s in skipped for s in section["steps"]], label=group)
        )

    def render_event(self) -> None:
        index = self.event_list.value
        if index is None or index >= len(self.events):
            self.event_view.value = "<em>no events</em>" if not self.events else ""
            return
        # the same card the static HTML and the Lab renderer show for this event
        self.event_view.value = styled(card_html(event_card(self.events[index])))

    # -- step range -----------------------------------------------------------------------------
    def _range(self) -> tuple[int, int]:
        return tuple(self.step_range.value)

    def _update_range_bounds(self) -> None:
        if not self.steps:
            return
        first, last = self.steps[0], self.steps[-1]
        if self.step_range.max != last or self.step_range.min != first:
            following = self._following
            self.step_range.max = max(last, self.step_range.min)
            self.step_range.min = first
            if following:
                self._set_range((first, last))

    def _set_range(self, value) -> None:
        self._programmatic = True
        try:
            self.step_range.value = value
        finally:
            self._programmatic = False

    def _on_range(self, change) -> None:
        if getattr(self, "_programmatic", False):
            return
        lo, hi = change["new"]
        self._following = hi >= (self.steps[-1] if self.steps else 0)
        self.render_light()
        if self._history is not None:
            section = slice_history(self._history, lo, hi)
            if section.get("steps"):
                self.heatmap.value = heatmap_png(section)
            if self._activations is not None:
                self._draw_activations(lo, hi)
            self.render_layer()

    def _rank_rows(self) -> str:
        """One row per rank when the watch is a multi-rank view (``nbguard.notebook.ranks``)."""
        rows = getattr(self.watch, "rank_rows", None)
        if not callable(rows):
            return ""
        cols = ("rank", "step", "loss", "total_grad_norm", "skipped", "events", "last_event")
        body = "".join("<tr>" + "".join(f"<td>{esc(row.get(c))}</td>" for c in cols) + "</tr>" for row in rows())
        return f"<table><tr>{''.join(f'<th>{esc(c.replace(chr(95), chr(32)))}</th>' for c in cols)}</tr>{body}</table>"

    @staticmethod
    def _event_label(event: dict) -> str:
        first = (event.get("origins") or [{}])[0]
        where = f" @ {first.get('module')} ({first.get('phase')})" if first.get("module") else ""
        rank = f" [rank {event['rank']}]" if event.get("rank") is not None else ""
        return f"step {event.get('step')}: {event.get('kind')}{rank}{where}"
