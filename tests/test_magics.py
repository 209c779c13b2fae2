"""The magics and the exception explainer in a real IPython InteractiveShell (both lanes)."""
from __future__ import annotations

import sys
import types

import pytest
import torch
from notebook_helpers import WIDGET_MIME, assert_fallbacks, run, shell, usage_line  # noqa: F401

SETUP = """
import torch
from nbguard.testing import tiny_llama, tiny_batch
my_model = tiny_llama(dtype=torch.float16)
"""


# -- loading ------------------------------------------------------------------------------------
def test_load_registers_magics_and_loading_twice_is_harmless(shell):
    magics = shell.magics_manager.magics
    assert {"precision_check", "nanwatch", "nbguard"} <= set(magics["line"]) and "nanwatch" in magics["cell"]
    callbacks = list(shell.events.callbacks["post_run_cell"])
    run(shell, "%load_ext nbguard")
    assert shell.events.callbacks["post_run_cell"] == callbacks
    assert shell.custom_exceptions == ()  # the explainer owns no exception handler


def test_unload_restores_previous_handler_and_removes_magics():
    from IPython.core.interactiveshell import InteractiveShell

    ip = InteractiveShell.instance()
    seen = []

    def previous(self, etype, value, tb, tb_offset=None):
        seen.append(value)
        return ["previous handler"]

    ip.set_custom_exc((KeyError,), previous)
    before_tb, before_exc = ip.CustomTB, ip.custom_exceptions
    try:
        run(ip, "%load_ext nbguard")
        assert ip.CustomTB is before_tb and ip.custom_exceptions == before_exc  # load leaves it alone
        cell = run(ip, "{}['x']")  # the earlier handler still gets its exceptions
        assert len(seen) == 1 and isinstance(seen[0], KeyError)
        run(ip, "%unload_ext nbguard")
        assert ip.CustomTB is before_tb and ip.custom_exceptions == before_exc
        assert "precision_check" not in ip.magics_manager.magics["line"]
        assert "nanwatch" not in ip.magics_manager.magics["cell"]
        cell = run(ip, "%precision_check")
        assert "UsageError" in cell.stdout + cell.stderr or cell.error is not None
    finally:
        ip.set_custom_exc((), None)
        ip.custom_exceptions = ()


# -- the explainer in the shell ---------------------------------------------------------------
def test_known_error_shows_traceback_then_diagnosis(shell, monkeypatch):
    order = []
    original = shell.showtraceback

    def spy(*args, **kwargs):
        order.append("traceback")
        return original(*args, **kwargs)

    monkeypatch.setattr(shell, "showtraceback", spy)
    cell = run(shell, "import torch\nloss = torch.randn(2, 3).sum()\nloss.backward()")
    assert isinstance(cell.error, RuntimeError)
    assert "element 0 of tensors does not require grad" in cell.stdout  # the normal traceback
    assert "loss.backward()" in cell.stdout
    assert order == ["traceback"]
    [doc] = cell.docs
    assert doc["kind"] == "diagnosis" and doc["diagnoses"][0]["signature"] == "no-grad-input"
    assert "enable-input-require-grads" in doc["fix_cells"]
    assert_fallbacks(cell.outputs)
    assert sys.last_value is cell.error  # %debug and friends still see the exception


def test_unknown_error_shows_only_the_traceback(shell):
    cell = run(shell, "1/0")
    assert isinstance(cell.error, ZeroDivisionError) and "ZeroDivisionError" in cell.stdout
    assert cell.docs == []


def test_syntax_error_still_reported_normally(shell):
    cell = run(shell, "def broken(:\n    pass")
    assert "SyntaxError" in cell.stdout + cell.stderr
    assert cell.docs == []


def test_diagnosis_fix_code_uses_the_notebook_names(shell):
    run(shell, SETUP)
    cell = run(shell, """
scaler = torch.amp.GradScaler("cpu")
opt = torch.optim.SGD(my_model.parameters(), lr=0.1)
scaler.scale(my_model(**tiny_batch()).loss.float()).backward()
scaler.unscale_(opt)
""")
    [doc] = cell.docs
    assert doc["diagnoses"][0]["signature"] == "fp16-unscale-error"
    assert "my_model" in doc["fix_cells"]["upcast-trainable-fp32"]["code"]


def test_nbguard_explain_reexplains_the_last_exception(shell):
    run(shell, "import torch\ntorch.multinomial(torch.tensor([float('nan'), 1.0]), 1)")
    cell = run(shell, "%nbguard explain")
    assert [d["diagnoses"][0]["signature"] for d in cell.docs] == ["sampling-nonfinite-probs"]


# -- %precision_check ---------------------------------------------------------------------------
def test_precision_check_finds_the_model_and_uses_its_name(shell):
    run(shell, SETUP)
    cell = run(shell, "%precision_check --hardware t4")
    assert cell.error is None and cell.stderr == ""
    [doc] = cell.docs
    rules = {f["rule"] for f in doc["findings"]}
    assert "trainable-low-precision" in rules
    assert "my_model" in doc["fix_cells"]["upcast-trainable-fp32"]["code"]
    assert doc["output_id"] and doc["hardware"]["name"] == "t4"
    assert WIDGET_MIME in cell.outputs[0]
    assert_fallbacks(cell.outputs)


@pytest.mark.parametrize("line, message", [
    ("%precision_check nope", "no variable named 'nope'"),
    ("%precision_check numbers", "'numbers' is a list"),
    ("%precision_check my_model --hardware tpu9", "tpu9"),
    ("%precision_check my_model --batch numbers", "--batch 'numbers' is a list"),
    ("%precision_check my_model --bogus", "unrecognized arguments"),
])
def test_precision_check_errors_are_one_line(shell, line, message):
    run(shell, SETUP + "numbers = [1, 2]")
    cell = run(shell, line)
    assert cell.docs == [] and message in usage_line(cell)


def test_precision_check_probe_with_named_batch(shell):
    run(shell, SETUP + "my_batch = tiny_batch()")
    cell = run(shell, "%precision_check my_model --probe --batch my_batch --hardware t4")
    [doc] = cell.docs
    assert cell.stderr == "" and doc["probe"]["modules"]
    assert {m["module"] for m in doc["probe"]["modules"]} & {n for n, _ in shell.user_ns["my_model"].named_modules()}


def test_precision_check_asks_when_ambiguous(shell):
    run(shell, SETUP + "other = tiny_llama()")
    cell = run(shell, "%precision_check")
    assert cell.docs == []
    line = usage_line(cell)
    assert line.startswith("nbguard: several models") and "my_model" in line and "other" in line
    cell = run(shell, "%precision_check other")
    assert len(cell.docs) == 1


def test_precision_check_ignores_submodule_aliases(shell):
    run(shell, SETUP + "head = my_model.lm_head")
    cell = run(shell, "%precision_check --hardware a100")
    assert len(cell.docs) == 1 and cell.stderr == ""


def test_precision_check_prefers_the_trainer(shell):
    run(shell, """
import torch
from transformers import Trainer, TrainingArguments
from nbguard.testing import tiny_llama, TinyDataset
model = tiny_llama(dtype=torch.float16)
trainer = Trainer(model=model, args=TrainingArguments(output_dir="/tmp/nbguard-magics", use_cpu=True,
                  report_to=[]), train_dataset=TinyDataset(8))
""")
    cell = run(shell, "%precision_check --hardware t4")
    [doc] = cell.docs
    assert "trainer.model" in doc["fix_cells"]["upcast-trainable-fp32"]["code"]


def test_without_ipywidgets_shows_static_bundle_with_hint(shell, monkeypatch):
    monkeypatch.setitem(sys.modules, "ipywidgets", None)  # import ipywidgets now raises ImportError
    run(shell, SETUP)
    cell = run(shell, "%precision_check --hardware t4")
    [data] = cell.outputs
    assert WIDGET_MIME not in data
    assert "pip install ipywidgets" in data["text/plain"] and "pip install ipywidgets" in data["text/html"]
    assert_fallbacks(cell.outputs)


def test_colab_gets_display_and_custom_widget_manager(shell, monkeypatch):
    from nbguard.notebook import display

    run(shell, SETUP + "import transformers, accelerate")  # real libraries first: they probe google.colab
    monkeypatch.setattr(display, "_colab_widgets_enabled", False)
    calls = []
    colab = types.ModuleType("google.colab")
    colab.output = types.SimpleNamespace(enable_custom_widget_manager=lambda: calls.append("enabled"))
    monkeypatch.setitem(sys.modules, "google", types.ModuleType("google"))
    monkeypatch.setitem(sys.modules, "google.colab", colab)
    monkeypatch.setitem(sys.modules, "google.colab.output", colab.output)
    cell = run(shell, "%precision_check --hardware t4")
    assert calls == ["enabled"]
    assert cell.result.result is None  # shown with display(), not as the cell's value
    assert WIDGET_MIME in cell.outputs[0]
    run(shell, "%precision_check --hardware t4")
    assert calls == ["enabled"]  # once per kernel


# -- %nbguard fix / report ----------------------------------------------------------------------
def test_nbguard_fix_sets_next_input_with_user_names(shell):
    run(shell, SETUP)
    run(shell, "%precision_check my_model --hardware t4")
    shell.rl_next_input = None
    cell = run(shell, "%nbguard fix upcast-trainable-fp32")
    assert cell.stderr == ""
    assert "my_model" in shell.rl_next_input
    assert shell.user_ns["my_model"].model.embed_tokens.weight.dtype == torch.float16  # only shown
    run(shell, shell.rl_next_input)  # the cell the user would run
    assert shell.user_ns["my_model"].model.embed_tokens.weight.dtype == torch.float32


def test_nbguard_fix_apply_changes_the_model(shell):
    run(shell, SETUP)
    cell = run(shell, "%nbguard fix upcast-trainable-fp32 --apply")
    assert "applied upcast-trainable-fp32" in cell.stdout
    assert all(p.dtype == torch.float32 for p in shell.user_ns["my_model"].parameters())
    # one line that counts what changed, not every parameter's name (the quickstart's was 1,921 characters)
    [applied] = [line for line in cell.stdout.splitlines() if "applied upcast-trainable-fp32" in line]
    changed = sum(1 for p in shell.user_ns["my_model"].parameters() if p.requires_grad)
    assert f"{changed} float16 -> float32" in applied and len(applied) <= 240
    assert "embed_tokens" not in applied


def test_nbguard_fix_unknown_id_is_one_line(shell):
    cell = run(shell, "%nbguard fix no-such-fix")
    assert usage_line(cell).startswith("nbguard: unknown fix id 'no-such-fix'")


def test_nbguard_report_writes_the_file(shell, tmp_path):
    run(shell, SETUP)
    run(shell, "%precision_check --hardware t4")
    path = tmp_path / "report.html"
    cell = run(shell, f"%nbguard report {path}")
    assert cell.stderr == "" and path.exists() and "trainable-low-precision" in path.read_text()


# -- %nanwatch ----------------------------------------------------------------------------------
LOOP = """
for i in range({steps}):
    opt.zero_grad()
    loss = net(**batch).loss
    loss.backward()
    opt.step()
"""
WATCH_SETUP = """
import torch
from nbguard.testing import tiny_llama, tiny_batch
net = tiny_llama()
opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
batch = tiny_batch()
"""


def _hook_counts(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in model.modules())


def test_nanwatch_attaches_with_the_unique_optimizer_and_off_detaches(shell):
    run(shell, WATCH_SETUP)
    net = shell.user_ns["net"]
    before = _hook_counts(net)
    cell = run(shell, "%nanwatch --policy warn")
    assert cell.stderr == "" and len(cell.docs) == 1 and WIDGET_MIME in cell.outputs[0]
    assert _hook_counts(net) > before
    run(shell, LOOP.format(steps=3))
    cell = run(shell, "%nanwatch off")
    assert _hook_counts(net) == before
    [doc] = cell.docs  # the summary, here
    assert doc["kind"] == "watch" and doc["history"]["steps"] == [0, 1, 2]
    [live] = cell.updated_docs  # and the live output above brought up to date in place
    assert live["history"]["steps"] == [0, 1, 2] and live["output_id"] != doc["output_id"]
    cell = run(shell, "%nanwatch off")
    assert usage_line(cell).startswith("nbguard: no watch")


def test_nanwatch_activations_shows_the_abs_max_heatmap_live_and_in_the_static_copy(shell):
    from nbguard.notebook.present import OPEN_VIEWS

    run(shell, WATCH_SETUP)
    cell = run(shell, "%nanwatch net --activations")
    assert cell.stderr == "" and WIDGET_MIME in cell.outputs[0]
    dash = OPEN_VIEWS[-1].dashboard
    assert dash.watch.activation_history is not None and dash.activations_heatmap.layout.display != "none"
    run(shell, LOOP.format(steps=2))
    cell = run(shell, "%nanwatch off")
    assert dash.errors == [] and dash.activations_heatmap.value[:8] == b"\x89PNG\r\n\x1a\n"
    [doc] = cell.docs
    assert doc["activations"]["steps"] == [0, 1] and "model.layers.1.mlp" in doc["activations"]["groups"]
    [live] = cell.updates
    assert "activation abs-max heatmap" in live["text/html"]  # the saved notebook keeps it too


def test_nanwatch_without_activations_has_no_activation_heatmap(shell):
    from nbguard.notebook.present import OPEN_VIEWS

    run(shell, WATCH_SETUP)
    run(shell, "%nanwatch net")
    dash = OPEN_VIEWS[-1].dashboard
    run(shell, LOOP.format(steps=1))
    cell = run(shell, "%nanwatch off")
    assert dash.activations_heatmap.layout.display == "none" and not dash.activations_heatmap.value
    assert "activations" not in cell.docs[0]


@pytest.mark.parametrize("line, message", [
    ("%nanwatch --policy explode", "invalid choice: 'explode'"),
    ("%nanwatch batch", "'batch' is a dict"),
    ("%nanwatch net --optimizer batch", "'batch' is a dict, expected a torch.optim.Optimizer"),
])
def test_nanwatch_errors_are_one_line(shell, line, message):
    run(shell, WATCH_SETUP)
    cell = run(shell, line)
    assert message in usage_line(cell)


def test_cell_nanwatch_around_trainer_train(shell):
    cell = run(shell, """
from transformers import Trainer, TrainingArguments
from nbguard.testing import tiny_llama, TinyDataset
trainer = Trainer(model=tiny_llama(), train_dataset=TinyDataset(8),
                  args=TrainingArguments(output_dir="/tmp/nbguard-nanwatch", use_cpu=True, report_to=[],
                                         max_steps=3, per_device_train_batch_size=2, save_strategy="no",
                                         logging_strategy="no", disable_tqdm=True))
""")
    assert cell.error is None
    cell = run(shell, "%%nanwatch\ntrainer.train()")
    assert cell.error is None and cell.stderr.count("nbguard:") == 0, cell.stderr
    assert "the watch detached when the cell ended" in cell.stdout  # its steps and events: the view's
    [live] = cell.updated_docs
    assert live["history"]["steps"] == [0, 1, 2] and live["events"] == []


def test_cell_nanwatch_error_shows_traceback_diagnosis_and_detaches(shell):
    run(shell, WATCH_SETUP)
    net = shell.user_ns["net"]
    before = _hook_counts(net)
    cell = run(shell, "%%nanwatch net\n" + LOOP.format(steps=1) + "torch.randn(2).sum().backward()")
    assert "element 0 of tensors does not require grad" in cell.stdout  # the traceback of the inner cell
    assert [d["kind"] for d in cell.docs] == ["watch", "diagnosis"]
    assert "the watch detached when the cell ended" in cell.stdout and _hook_counts(net) == before
    assert cell.updated_docs[-1]["history"]["steps"] == [0] and cell.updated_docs[-1]["history"]["skipped_steps"] == []


def test_nanwatch_without_ipywidgets_is_static_with_hint(shell, monkeypatch):
    run(shell, WATCH_SETUP)
    monkeypatch.setitem(sys.modules, "ipywidgets", None)
    cell = run(shell, "%nanwatch net")
    [data] = cell.outputs
    assert WIDGET_MIME not in data and "pip install ipywidgets" in data["text/plain"]
    run(shell, LOOP.format(steps=2))
    cell = run(shell, "%nanwatch off")
    assert cell.docs[0]["history"]["steps"] == [0, 1]
    assert_fallbacks(cell.outputs + cell.updates)


def test_nanwatch_model_without_optimizer_says_so(shell):
    run(shell, "from nbguard.testing import tiny_llama\nnet = tiny_llama()")
    cell = run(shell, "%nanwatch net")
    assert usage_line(cell).startswith("nbguard: a model needs its optimizer")


def test_cell_nanwatch_watches_the_cell_then_summarises(shell):
    run(shell, WATCH_SETUP)
    net = shell.user_ns["net"]
    before = _hook_counts(net)
    cell = run(shell, "%%nanwatch net --policy skip\n" + LOOP.format(steps=2) +
               "with torch.no_grad():\n    net.model.layers[0].mlp.down_proj.weight[0, 0] = float('nan')\n"
               + LOOP.format(steps=1))
    assert _hook_counts(net) == before  # detached when the cell ended
    assert "the watch detached when the cell ended (policy skip)" in cell.stdout
    assert cell.updated_docs[-1]["history"]["steps"] == [0, 1, 2]  # the steps are the view's
    from nbguard.session import SESSION

    watch = SESSION.watches[-1]
    assert watch.events and watch.events[0].step == 2
    assert_fallbacks(cell.outputs)
