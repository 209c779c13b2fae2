"""Notebook citizenship of the magics, in a real IPython InteractiveShell (both lanes).

Bad input fails the cell with IPython's UsageError (one line); a bug inside nbguard is nbguard's
own error naming itself a bug; ``%magic?`` is the manual; Tab completes the notebook's objects;
the explainer rides on ``post_run_cell`` so ``%xmode`` and other handlers keep working; unload
removes exactly what load added; fix cells and the session's fixes use the notebook's names.
"""
from __future__ import annotations

import sys

import pytest
import torch
from notebook_helpers import run, shell, usage_line  # noqa: F401

from nbguard.errors import NbguardError
from nbguard.session import SESSION

SETUP = """
import torch
from nbguard.testing import tiny_llama, tiny_batch
my_model = tiny_llama(dtype=torch.float16)
my_opt = torch.optim.AdamW(my_model.parameters(), lr=1e-3)
numbers = [1, 2]
"""


# -- bad input fails the cell; internal errors are nbguard's own ------------------------------------
@pytest.mark.parametrize("line, message", [
    ("%precision_check nope", "no variable named 'nope'"),
    ("%precision_check my_model --hardware tpu9", "--hardware: hardware='tpu9' is not a known profile"),
    ("%precision_check my_model --probe --batch numbers", "--batch 'numbers' is a list"),
    ("%precision_check 'my_model", "No closing quotation"),
    ("%nanwatch my_model --policy explode", "%nanwatch: argument --policy: invalid choice: 'explode'"),
    ("%nanwatch numbers", "'numbers' is a list"),
    ("%nbguard", "%nbguard: the following arguments are required: command"),
    ("%nbguard fixx upcast-trainable-fp32", "invalid choice: 'fixx'"),
    ("%nbguard fix", "which fix?"),
    ("%nbguard report", "where to?"),
    ("%nbguard report out.txt", "cannot tell the report format from 'out.txt'"),
    ("%nbguard explain now", "takes no argument"),
    ("%nbguard report out.html --apply", "--apply goes with %nbguard fix"),
])
def test_bad_input_fails_the_cell_with_one_usage_line(shell, line, message):
    run(shell, SETUP)
    cell = run(shell, line)
    assert message in usage_line(cell) and cell.docs == []


def test_good_input_does_not_fail_the_cell(shell):
    run(shell, SETUP)
    cell = run(shell, "%precision_check my_model --hardware t4")
    assert cell.error is None and cell.stderr == "" and len(cell.docs) == 1


def test_an_internal_error_is_nbguards_own_with_a_hint_to_report_it(shell, monkeypatch):
    run(shell, SETUP)
    import nbguard.auditor as auditor

    def broken_rules(ctx):
        raise KeyError("dtype")  # a bug in a rule, not the user's input

    monkeypatch.setattr(auditor, "_run_rules", broken_rules)
    cell = run(shell, "%precision_check my_model --hardware t4")
    assert isinstance(cell.error, NbguardError) and not isinstance(cell.error, ValueError)
    assert "%precision_check failed inside nbguard (KeyError: 'dtype')" in str(cell.error)
    assert "bug in nbguard" in str(cell.error) and "please report it" in str(cell.error)
    assert isinstance(cell.error.__cause__, KeyError)  # the real traceback is chained below
    assert not (cell.stdout + cell.stderr).lstrip().startswith("UsageError") and "Traceback" in cell.stdout


# -- magics are their own manual --------------------------------------------------------------------
@pytest.mark.parametrize("magic, kind, options", [
    ("precision_check", "line", ["--hardware", "--probe", "--batch", "OBJ"]),
    ("nanwatch", "line", ["--policy", "--optimizer", "--scaler", "--activations", "OBJ", "off"]),
    ("nanwatch", "cell", ["--policy", "--optimizer", "--scaler", "--activations", "%%nanwatch"]),
    ("nbguard", "line", ["fix", "report", "explain", "--apply", "ID_OR_PATH"]),
])
def test_question_mark_shows_every_option_with_its_meaning_and_an_example(shell, magic, kind, options):
    doc = shell.magics_manager.magics[kind][magic].__doc__
    assert "Examples::" in doc and f"%{magic}" in doc.split("Examples::")[1]
    for option in options:
        assert option in doc, (option, doc)
    cell = run(shell, f"%{magic}?" if kind == "line" else f"%%{magic}?")
    help_text = "".join(str(o.get("text/plain", "")) for o in cell.outputs) + cell.stdout
    assert "--policy" in help_text if magic == "nanwatch" else options[0] in help_text


def test_every_option_of_every_magic_has_a_help_text(shell):
    for kind, names in (("line", ("precision_check", "nanwatch", "nbguard")), ("cell", ("nanwatch",))):
        for name in names:
            parser = shell.magics_manager.magics[kind][name].parser
            for action in parser._actions:
                if action.dest != "help":
                    assert action.help and len(action.help) > 20, (name, action.dest)


# -- completion ---------------------------------------------------------------------------------------
def _complete(shell, line: str) -> list[str]:
    _text, matches = shell.complete("", line, len(line))
    return matches


def test_tab_completes_the_notebooks_objects_of_the_right_kind(shell):
    run(shell, SETUP + "args_like = {'input_ids': 1}\n")
    assert "my_model" in _complete(shell, "%precision_check my_")
    assert "numbers" not in _complete(shell, "%precision_check num")  # a list is not auditable
    assert _complete(shell, "%nanwatch my_model --optimizer my_") == ["my_opt"]
    assert "t4" in _complete(shell, "%precision_check my_model --hardware t")
    assert set(_complete(shell, "%nanwatch --policy s")) == {"skip", "stop"}
    assert "--activations" in _complete(shell, "%nanwatch my_model --act")
    assert "off" in _complete(shell, "%nanwatch o")
    assert set(_complete(shell, "%nbguard ")) >= {"fix", "report", "explain"}
    assert "upcast-trainable-fp32" in _complete(shell, "%nbguard fix upc")
    assert _complete(shell, "%nbguard fix upcast-trainable-fp32 --apply --f") == ["--force"]


def test_unload_removes_the_completers(shell):
    run(shell, SETUP)
    dispatcher = shell.strdispatchers["complete_command"]
    assert "%precision_check" in dispatcher.strs
    run(shell, "%unload_ext nbguard")
    try:
        assert not {"%precision_check", "%nanwatch", "%%nanwatch", "%nbguard"} & set(dispatcher.strs)
        assert "import" in dispatcher.strs  # IPython's own completers untouched
    finally:
        run(shell, "%load_ext nbguard")


# -- the explainer rides on IPython's events ----------------------------------------------------------
KNOWN_ERROR = "import torch\ntorch.randn(2, 3).sum().backward()"


def test_xmode_applies_to_the_traceback_and_the_diagnosis_follows(shell):
    run(shell, "%xmode Minimal")
    try:
        cell = run(shell, KNOWN_ERROR)
        assert isinstance(cell.error, RuntimeError)
        assert "RuntimeError: element 0 of tensors does not require grad" in cell.stdout
        assert "Traceback" not in cell.stdout and "----> " not in cell.stdout  # Minimal: no frames
        assert [d["diagnoses"][0]["signature"] for d in cell.docs] == ["no-grad-input"]
    finally:
        run(shell, "%xmode Context")
    cell = run(shell, KNOWN_ERROR)
    assert "Traceback" in cell.stdout and "----> " in cell.stdout and len(cell.docs) == 1


def test_another_extensions_handler_keeps_its_exceptions_and_nbguard_still_explains(shell):
    seen = []

    def other(self, etype, value, tb, tb_offset=None):
        seen.append(value)
        return ["handled by the other extension"]

    shell.set_custom_exc((RuntimeError,), other)
    try:
        cell = run(shell, KNOWN_ERROR)
        assert len(seen) == 1 and isinstance(seen[0], RuntimeError)
        assert [d["diagnoses"][0]["signature"] for d in cell.docs] == ["no-grad-input"]
    finally:
        shell.set_custom_exc((), None)


def test_unload_removes_exactly_the_callbacks_load_added(shell):
    run(shell, "%unload_ext nbguard")
    before = {name: list(callbacks) for name, callbacks in shell.events.callbacks.items()}
    showwarning = __import__("warnings").showwarning
    run(shell, "%load_ext nbguard")
    added = {name: [c for c in callbacks if c not in before[name]] for name, callbacks in shell.events.callbacks.items()}
    assert len(added["post_run_cell"]) == 2 and not any(added[n] for n in added if n != "post_run_cell")
    run(shell, "%unload_ext nbguard")
    try:
        assert {name: list(c) for name, c in shell.events.callbacks.items()} == before
        assert __import__("warnings").showwarning == showwarning
        assert shell.custom_exceptions == ()
        assert run(shell, KNOWN_ERROR).docs == []  # no diagnosis once unloaded
    finally:
        run(shell, "%load_ext nbguard")


def test_nbguard_explain_still_explains_the_last_error(shell):
    run(shell, KNOWN_ERROR)
    cell = run(shell, "%nbguard explain")
    assert [d["diagnoses"][0]["signature"] for d in cell.docs] == ["no-grad-input"]


# -- %%nanwatch: a failing watched cell fails the cell, once ----------------------------------------
def test_a_failing_watched_cell_fails_with_its_own_error_shown_once(shell):
    run(shell, SETUP)
    cell = run(shell, "%%nanwatch my_model --optimizer my_opt\nimport torch\ntorch.randn(2, 3).sum().backward()")
    assert isinstance(cell.error, RuntimeError) and "does not require grad" in str(cell.error)
    assert cell.stdout.count("element 0 of tensors does not require grad") == 1  # one traceback
    assert [d["kind"] for d in cell.docs] == ["watch", "diagnosis"]  # one diagnosis
    assert sys.last_value is cell.error


def test_a_watched_cell_that_succeeds_succeeds(shell):
    run(shell, SETUP)
    cell = run(shell, "%%nanwatch my_model --optimizer my_opt\nx = 1 + 1")
    assert cell.error is None and shell.user_ns["x"] == 2


# -- fix cells true to the notebook -------------------------------------------------------------------
TRAINER = """
from transformers import Trainer, TrainingArguments
from nbguard.testing import TinyDataset
my_args = TrainingArguments(output_dir={out!r}, use_cpu=True, report_to=[], max_steps=1, learning_rate=1e-3)
"""


def test_fix_apply_records_the_notebooks_own_names(shell):
    run(shell, SETUP)
    run(shell, "%precision_check my_model --hardware t4")
    cell = run(shell, "%nbguard fix upcast-trainable-fp32 --apply")
    assert cell.error is None
    [record] = SESSION.fixes_applied
    assert "my_model" in record["code"] and "model." not in record["code"].replace("my_model.", "")
    assert SESSION.timeline[-1].kind == "fix"


def test_fix_apply_passes_the_training_arguments_from_the_namespace(shell, tmp_path):
    run(shell, SETUP + TRAINER.format(out=str(tmp_path)))
    cell = run(shell, "%nbguard fix lower-learning-rate --apply")
    assert cell.error is None, cell.stderr
    assert shell.user_ns["my_args"].learning_rate < 1e-3  # applied to the user's own args
    [record] = SESSION.fixes_applied
    assert "my_args.learning_rate" in record["code"] and "my_args" in shell.rl_next_input


def test_fix_apply_names_what_is_missing(shell):
    run(shell, SETUP)
    cell = run(shell, "%nbguard fix lower-learning-rate --apply")
    line = usage_line(cell)
    assert "'lower-learning-rate' acts on TrainingArguments, a Trainer, or a plain loop's optimizer" in line
    assert SESSION.fixes_applied == []


def test_widget_apply_records_the_notebooks_own_names(shell):
    run(shell, SETUP)
    run(shell, "%precision_check my_model --hardware t4")
    from nbguard.notebook.present import OPEN_VIEWS

    OPEN_VIEWS[-1].fix_row("trainable-low-precision", "upcast-trainable-fp32").apply()
    [record] = SESSION.fixes_applied
    assert "my_model" in record["code"]
    assert all(p.dtype == torch.float32 for p in shell.user_ns["my_model"].parameters() if p.requires_grad)


def test_a_fix_that_does_not_fit_the_object_is_a_usage_error_not_a_bug(shell):
    run(shell, "import torch\nnet = torch.nn.Linear(4, 4)")
    line = usage_line(run(shell, "%nbguard fix enable-input-require-grads --apply"))
    assert "enable-input-require-grads cannot apply here" in line and "transformers" in line


TOKENIZER = """
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
backend = Tokenizer(models.WordLevel({"[PAD]": 0, "[UNK]": 1, "hi": 2}, unk_token="[UNK]"))
backend.pre_tokenizer = pre_tokenizers.Whitespace()
my_tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]", padding_side="left")
"""


def test_fix_apply_passes_the_notebooks_tokenizer(shell):
    run(shell, SETUP + TOKENIZER)
    cell = run(shell, "%nbguard fix pad-right-for-training --apply")
    assert cell.error is None, cell.stderr
    assert shell.user_ns["my_tok"].padding_side == "right"
    [record] = SESSION.fixes_applied
    assert 'my_tok.padding_side = "right"' in record["code"] and "my_tok" in shell.rl_next_input


def test_fix_apply_names_a_missing_tokenizer(shell):
    run(shell, SETUP)
    line = usage_line(run(shell, "%nbguard fix pad-right-for-training --apply"))
    assert "acts on a tokenizer or a Trainer" in line and SESSION.fixes_applied == []
