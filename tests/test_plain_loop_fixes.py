"""Issue 41, item 4: a plain PyTorch loop whose model is float16 and whose inputs it casts itself
(``model(x.to(torch.float16), ...)``) gets precision fixes that fit it, and a cell that was not enough is not applied.

The notebook is real: a nanoGPT-style model (it returns its loss) in float16, Adam, and a loop that feeds
float16 inputs, run in an IPython shell with nbguard loaded; one batch at step 4 overflows float16 in ``act``.
Upcasting the weights alone left the loop's float16 inputs meeting float32 weights ("mat1 and mat2 must have
the same dtype"): the fix's cell now casts them (one forward pre-hook, whose function the verifier also runs)
and moves the optimizer's moments with the weights.
"""
from __future__ import annotations

import re

import pytest
import torch
from notebook_helpers import run, shell, usage_line  # noqa: F401 - the fixture

import nbguard
import nbguard.fixes
from nbguard.document.view import recommended_fix, view
from nbguard.session import SESSION

torch.set_num_threads(1)
BAD_STEP = 4

NOTEBOOK = f"""
import torch

class Square(torch.nn.Module):
    def forward(self, x):
        return x * x

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.act = Square()
        self.fc2 = torch.nn.Linear(16, 1)

    def forward(self, x, y):
        out = self.fc2(self.act(self.fc1(x)))
        return out, ((out.float() - y.float()) ** 2).mean()

torch.manual_seed(0)
model = Net().to(torch.float16)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-4)
losses = []
BAD_STEP = {BAD_STEP}

def batch(step):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
    return (x * 400 if step == {BAD_STEP} else x), y

def train(steps, start=0):
    for step in range(start, start + steps):
        x, y = batch(step)
        optimizer.zero_grad()
        out, loss = model(x.to(torch.float16), y.to(torch.float16))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
"""


@pytest.fixture(autouse=True)
def _fresh_session():
    SESSION.clear()
    yield
    SESSION.clear()


def _watched(shell):  # noqa: F811
    assert run(shell, NOTEBOOK).error is None
    watched = run(shell, "%%nanwatch model --policy skip\ntrain(BAD_STEP + 1)")
    assert watched.error is None, watched.stderr
    watch = SESSION.watches[-1]
    [event] = [e for e in watch.events if e.kind.startswith("nonfinite")]
    assert (event.step, event.cause, event.origins[0].module) == (BAD_STEP, "overflow", "act")
    return watch


def test_the_recommended_cell_run_as_inserted_trains_healthy(shell):  # noqa: F811
    watch = _watched(shell)
    verdicts = {v.fix: v for v in watch.verification.verdicts}
    assert "init-new-embeddings" not in verdicts  # (item 5) Net has no embeddings: nothing for it to change
    for fix_id in ("upcast-trainable-fp32", "switch-precision"):
        assert verdicts[fix_id].verdict == "verified", (fix_id, verdicts[fix_id].reason)
        assert "install_input_cast(model)" in verdicts[fix_id].code  # the cell that ran carries the cast
    switch = verdicts["switch-precision"].code  # its header says what a loop without a Trainer computes in
    assert "# Train in fp32" in switch or "the loop\n# computes in bf16 only under its torch.autocast" in switch
    assert "# Train in bf16 instead of fp16.\n" not in switch
    card = next(c for s in view(watch.to_document()).sections if s.kind == "watch" for c in s.cards)
    fix = recommended_fix(card.fixes)
    assert fix is not None and fix.verdict.status == "verified"

    shell.rl_next_input = None
    shown = run(shell, f"%nbguard fix {fix.id}")
    assert shown.error is None and f"{fix.id}" in shown.stdout and "verified on the failing step" in shown.stdout
    inserted = shell.rl_next_input
    assert inserted == fix.code  # the cell inserted is the cell that was verified
    assert run(shell, inserted).error is None
    ran = run(shell, f"train(6, start={BAD_STEP})")  # the failing batch again, and more
    assert ran.error is None, ran.stderr
    losses = shell.user_ns["losses"][-6:]
    assert all(torch.isfinite(torch.tensor(losses))), losses
    model = shell.user_ns["model"]
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    moments = {s["exp_avg"].dtype for s in shell.user_ns["optimizer"].state.values()}
    assert moments == {torch.float32}  # the loop's optimizer follows its weights


def test_a_not_enough_cell_is_refused_unless_forced(shell):  # noqa: F811
    watch = _watched(shell)
    event = next(e for e in watch.events if e.kind.startswith("nonfinite"))
    clip = nbguard.verify(event, "enable-grad-clipping", watch=watch).verdict("enable-grad-clipping")
    assert clip.verdict == "not enough"
    hooks = len(shell.user_ns["optimizer"]._optimizer_step_pre_hooks)

    line = usage_line(run(shell, "%nbguard fix enable-grad-clipping --apply"))
    assert "enable-grad-clipping was not applied: this cell was not enough on the failing step" in line
    assert re.search(r"make (upcast-trainable-fp32|switch-precision) instead .*%nbguard fix \S+ --apply", line), line
    assert "--force" in line
    assert len(shell.user_ns["optimizer"]._optimizer_step_pre_hooks) == hooks  # nothing applied

    with pytest.raises(nbguard.fixes.FixNotEnough, match="force=True"):
        nbguard.fixes.apply("enable-grad-clipping", model=shell.user_ns["model"], optimizer=shell.user_ns["optimizer"])
    assert len(shell.user_ns["optimizer"]._optimizer_step_pre_hooks) == hooks

    forced = run(shell, "%nbguard fix enable-grad-clipping --apply --force")
    assert forced.error is None and "applied enable-grad-clipping" in forced.stdout
    assert len(shell.user_ns["optimizer"]._optimizer_step_pre_hooks) == hooks + 1


def test_force_goes_with_apply(shell):  # noqa: F811
    assert "--force goes with %nbguard fix ID --apply" in usage_line(run(shell, "%nbguard fix upcast-trainable-fp32 --force"))


def test_help_names_the_recommended_fix_the_story_and_the_card_name(shell):  # noqa: F811
    empty = run(shell, "%nbguard help")
    assert empty.error is None and "Nothing went wrong yet" in empty.stdout
    watch = _watched(shell)
    card = next(c for s in view(watch.to_document()).sections if s.kind == "watch" for c in s.cards)
    fix = recommended_fix(card.fixes).id
    story = [f.text for f in view(nbguard.report().to_dict()).section("story").facts]
    assert next(t for t in story if t.startswith("Fix: ")).startswith(f"Fix: {fix} ")
    shown = run(shell, "%nbguard help")
    assert shown.error is None
    assert f"Recommended fix: {fix}: %nbguard fix {fix} --apply" in shown.stdout
    assert "What went wrong: step 4: non-finite loss (overflow)" in shown.stdout
    assert len(shown.stdout.splitlines()) <= 12  # a few lines, not a report


def test_a_loss_computed_outside_the_model_is_not_blamed_on_the_fix():
    """The loop computes the loss from the model's output: the gradient it sent back at the failing step came
    from an inf output, so a re-run under a fix cannot judge the backward; the fix is not checked (saying why),
    never "not enough" because of that stale gradient."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), Square(), torch.nn.Linear(16, 1)).to(torch.float16)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    with nbguard.watch(model, optimizer=optimizer, policy="skip") as watch:
        for step in range(BAD_STEP + 1):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
            optimizer.zero_grad()
            out = model((x * 400 if step == BAD_STEP else x).half())
            ((out.float() - y) ** 2).mean().backward()
            optimizer.step()
    assert watch.events[0].cause == "overflow"
    upcast = watch.verification.verdict("upcast-trainable-fp32")
    assert upcast.verdict == "not checked" and "loss computed outside it" in upcast.reason, upcast.reason
    assert upcast.step.first_nonfinite is None  # its forward is finite: the input cast and fp32 weights hold


def test_float32_weights_fed_half_inputs_are_explained_with_the_cast_as_a_fix():
    """The error the issue met after an upcast that did not cast the inputs: the explainer's card said "cast the
    inputs to float32" and offered no cell; it offers cast-inputs-to-float32, and its cell makes the loop run."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), Square(), torch.nn.Linear(16, 1))  # float32
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError) as raised:
        model(x.half())
    diagnosis = nbguard.explain(raised.value)
    assert diagnosis.signature == "matmul-dtype-mismatch" and diagnosis.evidence["cause"] == "forced-fp32"
    assert diagnosis.fixes == ["cast-inputs-to-float32"]
    cell = nbguard.fixes.code("cast-inputs-to-float32", model="net")
    exec(cell, {"net": model})
    assert model(x.half()).dtype == torch.float32  # the loop's own x.half() now meets float32 weights
    assert nbguard.fixes.apply("cast-inputs-to-float32", model=model).changed == {}  # the cell did what apply does


class Square(torch.nn.Module):
    def forward(self, x):
        return x * x
