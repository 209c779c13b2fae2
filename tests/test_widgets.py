"""Widgets driven like a user: cards' buttons with .click(), the live dashboard on a real run."""
from __future__ import annotations

import itertools

import pytest
import torch
from dashboard_helpers import every_step_dashboard
from notebook_helpers import MIME, WIDGET_MIME, run, shell  # noqa: F401


def _view(shell):
    from nbguard.notebook.present import OPEN_VIEWS

    return OPEN_VIEWS[-1]


# -- finding cards ------------------------------------------------------------------------------
def test_apply_button_fixes_the_model_and_the_finding_disappears(shell):
    run(shell, "import torch\nfrom nbguard.testing import tiny_llama\nmy_model = tiny_llama(dtype=torch.float16)")
    first = run(shell, "%precision_check my_model --hardware a100")
    view = _view(shell)
    assert "trainable-low-precision" in view.result
    row = view.fix_row("trainable-low-precision", "upcast-trainable-fp32")
    from IPython.utils.capture import capture_output

    with capture_output() as cap:
        row.apply_button.click()
    model = shell.user_ns["my_model"]
    assert all(p.dtype == torch.float32 for p in model.parameters() if p.requires_grad)
    assert "trainable-low-precision" not in view.result  # re-audited
    assert view.resolved == ["trainable-low-precision"]
    assert "my_model" in view.header.value and "upcast-trainable-fp32" in view.header.value
    assert "trainable-low-precision" not in view.rows
    # the output of %precision_check was updated in place with the re-audited static view
    [update] = [o for o in cap.outputs if o.update]
    assert MIME in update.data and WIDGET_MIME in update.data
    assert update.data[MIME]["output_id"] == first.docs[0]["output_id"]
    assert "trainable-low-precision" not in {f["rule"] for f in update.data[MIME]["findings"]}


def test_apply_failure_is_shown_not_raised(shell):
    run(shell, "import torch\nfrom nbguard.testing import tiny_llama\nmy_model = tiny_llama(dtype=torch.float16)")
    run(shell, "%precision_check my_model --hardware a100")
    row = _view(shell).fix_row("trainable-low-precision", "upcast-trainable-fp32")
    row._apply = lambda fix_id: (_ for _ in ()).throw(RuntimeError("disk on fire"))
    row.apply_button.click()
    assert "Apply failed" in row.result.value and "disk on fire" in row.result.value
    assert not row.apply_button.disabled


def test_insert_cell_without_extension_shows_code_to_copy(shell):
    run(shell, "import torch\nfrom nbguard.testing import tiny_llama\nmy_model = tiny_llama(dtype=torch.float16)")
    run(shell, "%precision_check my_model --hardware a100")
    row = _view(shell).fix_row("trainable-low-precision", "upcast-trainable-fp32")
    row.insert_button.click()
    assert "<pre" in row.result.value and "my_model" in row.result.value
    assert "%nbguard fix upcast-trainable-fp32" in row.result.value
    assert shell.user_ns["my_model"].lm_head.weight.dtype == torch.float16  # nothing applied


def test_diagnosis_card_apply_fixes_the_named_model(shell):
    run(shell, "import torch\nfrom nbguard.testing import tiny_llama, tiny_batch\nm = tiny_llama(dtype=torch.float16)")
    cell = run(shell, """
opt = torch.optim.SGD(m.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu")
scaler.scale(m(**tiny_batch()).loss.float()).backward()
scaler.unscale_(opt)
""")
    assert cell.docs[0]["diagnoses"][0]["signature"] == "fp16-unscale-error"
    assert WIDGET_MIME in cell.outputs[0]
    view = _view(shell)
    view.fix_row("upcast-trainable-fp32").apply_button.click()
    assert all(p.dtype == torch.float32 for p in shell.user_ns["m"].parameters())
    assert "m.parameters()" in view.fix_row("upcast-trainable-fp32").result.value or \
        "m." in view.fix_row("upcast-trainable-fp32").result.value


def test_unload_closes_widgets_and_detaches_watches(shell):
    run(shell, "import torch\nfrom nbguard.testing import tiny_llama\nnet = tiny_llama()\n"
               "opt = torch.optim.SGD(net.parameters(), lr=0.1)")
    run(shell, "%nanwatch net")
    from nbguard.notebook.present import OPEN_VIEWS
    from nbguard.session import SESSION

    live = OPEN_VIEWS[-1]
    watch = SESSION.watches[-1]
    run(shell, "%unload_ext nbguard")
    assert not watch.attached and OPEN_VIEWS == []
    assert live.dashboard.widget.comm is None  # closed
    assert not live.dashboard.attached
    run(shell, "%load_ext nbguard")  # the fixture unloads again


# -- the dashboard ------------------------------------------------------------------------------
def _train(model, opt, steps, poison_at=None):
    from nbguard.testing import tiny_batch

    batch = tiny_batch()
    for step in range(steps):
        if step == poison_at:
            with torch.no_grad():
                model.model.layers[1].mlp.up_proj.weight[0, 0] = float("inf")
        opt.zero_grad()
        model(**batch).loss.backward()
        opt.step()


def test_dashboard_draws_heatmap_layers_events_and_origins():
    import nbguard
    from nbguard.testing import tiny_llama

    model = tiny_llama()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    announced = []
    with nbguard.watch(model, optimizer=opt, policy="skip") as watch:
        dash = every_step_dashboard(watch, on_new_events=lambda: announced.append(len(dash.events)))
        _train(model, opt, 5, poison_at=3)
        dash.finish()
    assert dash.errors == []
    assert announced and announced[0] >= 1 and announced[-1] == len(dash.events) == len(watch.events)
    assert dash.heatmap.value[:8] == b"\x89PNG\r\n\x1a\n"
    assert list(dash.steps) == [0, 1, 2, 3, 4] and dash.renders["heavy"] >= 5
    assert "model.layers.1.mlp" in dash.layer.options
    dash.layer.value = "model.layers.1.mlp"
    assert "model.layers.1.mlp" in dash.layer_view.value and "<svg" in dash.layer_view.value
    assert dash.events and dash.event_list.options
    dash.event_list.value = 0
    first_origin = watch.events[0].origins[0]
    assert first_origin.module in dash.event_view.value and first_origin.phase in dash.event_view.value
    assert "step 3" in dash.event_list.options[0][0]
    assert "#D55E00" in dash.sparks.value  # the non-finite loss is marked, not hidden in a gap
    png_all = dash.heatmap.value
    dash.step_range.value = (0, 2)  # zoom: the heatmap is redrawn for steps 0-2 only
    assert dash.heatmap.value != png_all
    assert "steps 0–2" in dash.layer_view.value


def test_dashboard_draws_the_activation_heatmap_when_the_watch_probes_and_zooms_it():
    import nbguard
    from nbguard.testing import tiny_llama

    model = tiny_llama()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nbguard.watch(model, optimizer=opt, activations=True) as watch:
        dash = every_step_dashboard(watch)
        _train(model, opt, 4)
        dash.finish()
    assert dash.errors == [] and dash.activations_heatmap.layout.display != "none"
    png_all = dash.activations_heatmap.value
    assert png_all[:8] == b"\x89PNG\r\n\x1a\n" and png_all != dash.heatmap.value
    dash.step_range.value = (0, 1)  # zoom: both heatmaps follow the step range
    assert dash.activations_heatmap.value[:8] == b"\x89PNG\r\n\x1a\n" and dash.activations_heatmap.value != png_all


def test_dashboard_throttles_drawing():
    import nbguard
    from nbguard.notebook.widgets.dashboard import WatchDashboard
    from nbguard.testing import tiny_llama

    model = tiny_llama()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    frozen_clock = iter([0.0] + [0.1] * 100)  # time barely moves during the run
    with nbguard.watch(model, optimizer=opt) as watch:
        dash = WatchDashboard(watch, clock=lambda: next(frozen_clock)).attach()
        _train(model, opt, 6)
    assert len(dash.steps) == 6 and dash.renders == {"light": 1, "heavy": 1}


def test_dashboard_adds_no_host_sync(monkeypatch):
    """Count every Tensor -> host read during identical runs with the dashboard off and on."""
    import nbguard
    from nbguard.testing import tiny_llama

    counts = {"n": 0}
    for name in ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__"):
        original = getattr(torch.Tensor, name)

        def counting(self, *a, _original=original, **k):
            counts["n"] += 1
            return _original(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counting)

    def reads(with_dashboard: bool) -> int:
        model = tiny_llama(seed=1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        with nbguard.watch(model, optimizer=opt) as watch:
            # no time budget: every step draws, however slow a busy machine makes the drawing
            dash = every_step_dashboard(watch) if with_dashboard else None
            counts["n"] = 0
            _train(model, opt, 4)
            n = counts["n"]
        if dash is not None:
            assert dash.renders["heavy"] == 4 and dash.renders["light"] == 4  # it did draw on every step
        return n

    off, on = reads(False), reads(True)
    assert off > 0  # the counter sees the watch's own single read per step
    assert on == off


class _StaticWatch:
    """A watch stand-in for the throttle test: a real GradHistory, listeners ignored."""

    def __init__(self):
        from nbguard.watcher.reads.history import GradHistory

        self.history = GradHistory(["model.layers.0.mlp", "model.layers.1.mlp"], 64)
        for step in range(10):
            self.history.append(step, [1.0, 2.0], 1.0, 2.0, None, False)

    def add_listener(self, callback):
        pass

    def remove_listener(self, callback):
        pass


@pytest.mark.parametrize("budgets, expected", [((0.01, 0.02), 1), ((0.0, 0.0), None)])
def test_drawing_cost_spaces_out_the_next_drawing(monkeypatch, budgets, expected):
    from nbguard.notebook.widgets import dashboard as D

    perf = itertools.count(0.0, 0.5)  # every timed drawing appears to cost 0.5 s
    monkeypatch.setattr(D.time, "perf_counter", lambda: next(perf))
    ticks = itertools.count(0.0, 1.0)
    dash = D.WatchDashboard(_StaticWatch(), clock=lambda: next(ticks), light_budget=budgets[0], heavy_budget=budgets[1])
    for step in range(10):
        dash.on_watch(None, "step", {"step": step, "loss": 1.0, "total_grad_norm": 2.0})
    if expected is not None:
        assert dash.renders == {"light": expected, "heavy": expected}  # 0.5 s cost -> next one 25-50 s later
    else:
        assert dash.renders["light"] >= 9 and dash.renders["heavy"] >= 3  # only the intervals hold it back


def test_finding_card_evidence_is_a_table_in_a_closed_accordion():
    import ipywidgets as W
    from audit_helpers import seed_peft_model

    import nbguard
    from nbguard.document.view import view as build_view
    from nbguard.notebook.widgets.cards import card_widget

    doc = nbguard.audit(seed_peft_model(), hardware="a100").to_document()
    card = next(c for c in build_view(doc).section("findings").cards if c.folds)
    accordion = next(w for w in card_widget(card, []).children if isinstance(w, W.Accordion))
    assert accordion.selected_index is None  # evidence waits until asked
    evidence = accordion.children[0].value
    assert evidence.startswith("<table>") and "{" not in evidence  # rows of name and value, not JSON
