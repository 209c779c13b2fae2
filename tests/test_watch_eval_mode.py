"""Training on in eval mode: model.eval() for a validation pass and no model.train() after it, in any loop."""
from __future__ import annotations

import pytest
import torch
from audit_helpers import make_args, make_trainer
from watch_helpers import batches

import nbguard
from nbguard.testing import tiny_llama
from nbguard.watcher.detectors.eval_mode import KIND, TrainedInEvalMode

torch.set_num_threads(1)


def eval_events(watch):
    return [e for e in watch.events if e.kind == KIND]


def plain_loop(model, opt, data, *, validate_at: int, train_after: bool, modes: list | None = None):
    """A plain loop that runs a validation pass before step ``validate_at`` (and maybe model.train() after it)."""
    for step, batch in enumerate(data):
        if step == validate_at:
            model.eval()
            with torch.no_grad():
                model(**data[0])
            if train_after:
                model.train()
        if modes is not None:
            modes.append(model.training)
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad()


def test_a_validation_pass_without_model_train_is_one_event_at_the_step_it_started():
    model = tiny_llama(attention_dropout=0.2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    modes: list[bool] = []
    with nbguard.watch(model, optimizer=opt) as watch:
        plain_loop(model, opt, batches(9), validate_at=4, train_after=False, modes=modes)
    assert modes == [True] * 4 + [False] * 5  # the loop really trained in eval mode from step 4
    [event] = eval_events(watch)  # one event for the run, not one per step
    ev = event.evidence
    assert event.step == 4 and ev["first_step"] == 4 and ev["last_step"] == 8 and ev["steps_in_eval"] == 5
    assert ev["count"] == 2 and ev["dropout"] == 2 and ev["batch_norm"] == 0  # two attention layers, p=0.2
    assert ev["modules"] == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert ev["model_in_eval"] is True and ev["fixes"] == ["model-train-mode"]
    assert "model.train()" in event.message and "step 4" in event.message
    # the fix, as a cell and as an action: the model trains again, with dropout
    cell = nbguard.fixes.code("model-train-mode", model="net")
    assert "net.train()" in cell
    namespace = {"net": model}
    exec(compile(cell, "<cell>", "exec"), namespace)
    assert model.training and all(m.training for m in model.modules())
    model.eval()
    assert nbguard.fixes.apply("model-train-mode", model=model).changed and model.training
    assert not nbguard.fixes.apply("model-train-mode", model=model).changed  # idempotent


def test_a_loop_that_calls_model_train_after_validation_is_quiet():
    model = tiny_llama(attention_dropout=0.2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    modes: list[bool] = []
    with nbguard.watch(model, optimizer=opt) as watch:
        plain_loop(model, opt, batches(9), validate_at=4, train_after=True, modes=modes)
    assert modes == [True] * 9 and watch.step == 9
    assert eval_events(watch) == []


def test_a_model_without_dropout_in_eval_mode_is_quiet():
    model = tiny_llama()  # attention_dropout 0: eval mode changes nothing in its forward
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    modes: list[bool] = []
    with nbguard.watch(model, optimizer=opt) as watch:
        plain_loop(model, opt, batches(6), validate_at=2, train_after=False, modes=modes)
    assert modes[2:] == [False] * 4 and watch.step == 6
    assert eval_events(watch) == []


class BatchNormNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                        torch.nn.Linear(16, 1))

    def forward(self, x):
        return self.body(x)


def bn_loop(model, opt, steps: int, eval_at: int | None = None):
    torch.manual_seed(1)
    for step in range(steps):
        if step == eval_at:
            model.eval()
        x = torch.randn(16, 8)
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()


def test_batch_norm_left_in_eval_mode_is_reported_and_its_statistics_stopped():
    model = BatchNormNet()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nbguard.watch(model, optimizer=opt) as watch:
        bn_loop(model, opt, 3)
        frozen = model.body[1].running_mean.clone()
        bn_loop(model, opt, 3, eval_at=0)
    assert torch.equal(frozen, model.body[1].running_mean)  # what eval mode did: statistics never updated
    [event] = eval_events(watch)
    assert event.step == 3 and event.evidence["modules"] == ["body.1"]
    assert event.evidence["batch_norm"] == 1 and event.evidence["dropout"] == 0
    assert event.evidence["steps_in_eval"] == 3 and "batch-norm" in event.message


def test_batch_norm_frozen_on_purpose_inside_a_training_model_is_quiet():
    model = BatchNormNet()
    model.body[1].eval()  # frozen batch-norm, as fine-tuning recipes do; the model itself trains
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nbguard.watch(model, optimizer=opt) as watch:
        bn_loop(model, opt, 4)
    assert model.training and not model.body[1].training and watch.step == 4
    assert eval_events(watch) == []


class OwnFlagWrapper(torch.nn.Module):
    """A wrapper whose train() sets only its own flag."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, **kwargs):
        return self.inner(**kwargs)

    def train(self, mode: bool = True):
        self.training = mode
        return self


def test_a_wrapper_whose_train_does_not_reach_its_dropout_is_reported_with_the_dropout_fix():
    model = OwnFlagWrapper(tiny_llama(attention_dropout=0.2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with nbguard.watch(model, optimizer=opt) as watch:
        for step, batch in enumerate(batches(4)):
            if step == 1:
                model.inner.eval()  # a sampling callback's evaluation
                model.train()  # the loop's own call: it reaches the wrapper's flag only
            model(**batch).loss.backward()
            opt.step()
            opt.zero_grad()
    [event] = eval_events(watch)
    assert event.step == 1 and event.evidence["model_in_eval"] is False
    assert event.evidence["fixes"] == ["dropout-train-mode"] and event.evidence["count"] == 2


def test_the_trainer_with_evaluations_is_quiet(tmp_path):
    model = tiny_llama(attention_dropout=0.2)
    args = make_args(tmp_path, max_steps=6, eval_strategy="steps", eval_steps=2, per_device_train_batch_size=2)
    trainer = make_trainer(model, args)
    watch = nbguard.watch(trainer)
    trainer.train()
    watch.detach()
    evaluations = [log for log in trainer.state.log_history if "eval_loss" in log]
    assert len(evaluations) == 3 and watch.step == 6  # it evaluated (model.eval()) between training steps
    assert eval_events(watch) == []


def test_from_pretrained_in_eval_mode_trained_without_model_train_is_reported_from_step_0(tmp_path):
    from transformers import AutoModelForCausalLM

    tiny_llama(attention_dropout=0.2).save_pretrained(tmp_path / "m")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    assert not model.training  # from_pretrained returns the model in eval mode
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with nbguard.watch(model, optimizer=opt) as watch:
        for batch in batches(3):
            model(**batch).loss.backward()
            opt.step()
            opt.zero_grad()
    [event] = eval_events(watch)
    assert event.step == 0 and event.evidence["steps_in_eval"] == 3


@pytest.mark.parametrize("training", [True, False])
def test_it_asks_for_nothing_in_the_read_and_walks_the_model_rarely(training, monkeypatch):
    """No host sync of its own: no scalars; the modules are listed once per REFRESH steps, not per step."""
    model = tiny_llama(attention_dropout=0.2)
    model.train(training)
    walks = []
    original = torch.nn.Module.named_modules

    def counting(self, *args, **kwargs):
        if self is model:
            walks.append(1)
        return original(self, *args, **kwargs)

    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    with nbguard.watch(model, optimizer=opt) as watch:
        assert TrainedInEvalMode().scalars(watch) == {}
        monkeypatch.setattr(torch.nn.Module, "named_modules", counting)
        for batch in batches(1) * 60:
            model(**batch).loss.backward()
            opt.step()
            opt.zero_grad()
        monkeypatch.undo()
    assert watch.step == 60
    [event] = eval_events(watch) or [None]
    assert (event is None) == training and (training or event.evidence["steps_in_eval"] == 60)
    assert len(walks) <= 1  # one listing in 60 steps (refreshed every 200), not one per step
