"""Issue 41, item 5: a fix is offered only where it applies, and when it does not, the message names what the
user has. Every registered fix meets a plain PyTorch loop without any of the parts fixes change (no Trainer,
TrainingArguments or tokenizer; no config, embeddings, dropout, MoE routers, adapters or checkpointing): each is
either not offered, with a reason naming the loop's own objects, or applying it changes something real.
"""
from __future__ import annotations

import pytest
import torch
from audit_helpers import add_zero_tokens
from notebook_helpers import run, shell, usage_line  # noqa: F401 - the fixture

import nbguard.fixes as fixes
from nbguard.fixes.parts import LACKS, not_offered
from nbguard.fixes.registry import Target
from nbguard.testing import tiny_llama

torch.set_num_threads(1)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 1)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _plain_loop():
    torch.manual_seed(0)
    net = Net().to(torch.float16)
    return net, torch.optim.Adam(net.parameters(), lr=1e-3)  # eps=1e-8: 0 in float16, so its fix applies


@pytest.mark.parametrize("fix_id", fixes.available())
def test_every_fix_against_a_plain_loop_without_its_part(fix_id):
    net, opt = _plain_loop()
    fix = fixes.get(fix_id)
    why = not_offered(fix, Target(model=net, optimizer=opt))
    if why is not None:
        assert why.startswith(repr(fix_id)) and ("Net" in why or "Adam" in why), why  # it names what the user has
        return
    result = fixes.apply(fix_id, model=net, optimizer=opt, **fix.options_for("t4"))
    assert result.changed, f"{fix_id} is offered to a plain loop where it changes nothing"


def test_the_fixes_not_offered_to_a_plain_loop_say_why():
    net, opt = _plain_loop()
    target = Target(model=net, optimizer=opt)
    assert not_offered(fixes.get("init-new-embeddings"), target) == \
        "'init-new-embeddings' changes nothing here: Net has no embedding matrix"
    assert not_offered(fixes.get("drop-rows"), target) == \
        "'drop-rows' acts on a Trainer, and there is none here: there is a model (Net) and an optimizer (Adam)"
    with pytest.raises(ValueError, match=r"you gave a model \(Net\) and an optimizer \(Adam\)"):
        fixes.apply("drop-rows", model=net, optimizer=opt, indices=[0])


@pytest.mark.parametrize(("fix_id", "build"), [
    ("init-new-embeddings", lambda: add_zero_tokens(tiny_llama())),
    ("disable-use-cache", tiny_llama),
    ("set-attn-implementation", tiny_llama),
    ("resize-token-embeddings", tiny_llama),
])
def test_a_model_with_the_part_is_offered_its_fix(fix_id, build):
    assert fix_id in LACKS
    assert not_offered(fixes.get(fix_id), Target(model=build())) is None


def test_the_magic_names_what_the_notebook_has(shell):  # noqa: F811
    run(shell, "import torch\nnet = torch.nn.Sequential(torch.nn.Linear(4, 4))\n"
               "opt = torch.optim.SGD(net.parameters(), lr=0.1)")
    line = usage_line(run(shell, "%nbguard fix drop-rows --apply"))
    assert "'drop-rows' acts on a Trainer, and there is none here: there is a model (Sequential)" in line, line
    assert "'net'" in line
