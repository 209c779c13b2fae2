"""Bad magic input of every shape fails the cell with one UsageError line naming what was wrong,
never "this is a bug in nbguard" with a traceback (a real IPython InteractiveShell, a real tiny model)."""
from __future__ import annotations

import pytest
from notebook_helpers import run, shell, usage_line  # noqa: F401

SETUP = """
import torch
from nbguard.testing import tiny_llama, tiny_batch
my_model = tiny_llama(dtype=torch.float32)
other_model = tiny_llama(dtype=torch.float32)
my_opt = torch.optim.AdamW(my_model.parameters(), lr=1e-3)
other_opt = torch.optim.AdamW(other_model.parameters(), lr=1e-3)
b = tiny_batch()
as_lists = {k: v.tolist() for k, v in b.items()}
no_ids = {"attention_mask": b["attention_mask"], "labels": b["labels"]}
float_ids = dict(b, input_ids=b["input_ids"].float())
past_vocab = dict(b, input_ids=b["input_ids"] + 100000)
negative = dict(b, input_ids=b["input_ids"] - 1000)
one_row = dict(b, input_ids=b["input_ids"][0])
short_labels = dict(b, labels=b["labels"][:, :3])
empty = {}
layers = torch.nn.ModuleDict({"a": torch.nn.Linear(2, 2)})
numbers = [1, 2]
"""

BAD_LINES = [
    ("%precision_check my_model --probe --batch as_lists", "--batch 'as_lists' must hold tensors, but 'input_ids' is a list"),
    ("%precision_check my_model --verify --batch as_lists", "'labels' is a list"),
    ("%precision_check my_model --probe --batch no_ids", "--batch 'no_ids' has no 'input_ids' (its keys: 'attention_mask', 'labels')"),
    ("%precision_check my_model --probe --batch float_ids", "input_ids is float32; token ids must be an integer tensor"),
    ("%precision_check my_model --probe --batch past_vocab", "input_ids holds id 100"),
    ("%precision_check my_model --probe --batch negative", "input_ids holds the negative id"),
    ("%precision_check my_model --probe --batch one_row", "input_ids has shape (16,); expected (batch, sequence)"),
    ("%precision_check my_model --probe --batch short_labels", "labels has shape (2, 3) but input_ids has (2, 16)"),
    ("%precision_check my_model --probe --batch empty", "--batch 'empty' is empty"),
    ("%precision_check my_model --batch layers", "--batch 'layers' is a ModuleDict, expected a dict of tensors"),
    ("%precision_check my_model --batch numbers", "--batch 'numbers' is a list"),
    ("%precision_check my_model --batch b.nope", "'b' has no attribute 'nope'"),
    ("%precision_check my_model --batch 3", "'3' is not a variable name"),
    ("%precision_check my_model other_opt", "'other_opt' updates none of the parameters of 'my_model'"),
    ("%precision_check my_model other_model", "two models given"),
    ("%precision_check my_model --hardware ''", "--hardware: "),
    ("%precision_check my_model --probe=yes", "%precision_check: argument --probe: ignored explicit argument 'yes'"),
    ("%nanwatch my_model --optimizer other_opt", "--optimizer 'other_opt' updates none of this model's parameters"),
    ("%nanwatch my_model --optimizer numbers", "'numbers' is a list, expected a torch.optim.Optimizer"),
    ("%nanwatch my_model --optimizer my_opt --scaler my_opt", "'my_opt' is a AdamW, expected a torch.amp.GradScaler"),
    ("%nanwatch my_model --optimizer my_opt --policy 3", "argument --policy: invalid choice: '3'"),
    ("%nanwatch b", "'b' is a dict; %nanwatch takes a Trainer or a torch.nn.Module"),
    ("%nanwatch my_model extra", "unrecognized arguments: extra"),
    ("%nbguard fix nope", "unknown fix id 'nope'"),
    ("%nbguard fix disable-use-cache more", "%nbguard fix takes one argument (got 'more' too)"),
    ("%nbguard report out", "cannot tell the report format from 'out'"),
]


@pytest.mark.parametrize(("line", "message"), BAD_LINES)
def test_bad_magic_input_is_one_usage_line_naming_what_was_wrong(shell, line, message):
    run(shell, SETUP)
    cell = run(shell, line)
    said = usage_line(cell)
    assert message in said and "bug in nbguard" not in said
    assert not shell.magics_manager.registry["NbguardMagics"].state.watches  # no watch left behind


def test_a_good_batch_still_runs_the_probe(shell):
    run(shell, SETUP)
    cell = run(shell, "%precision_check my_model --probe --batch b")
    assert cell.error is None and cell.docs
