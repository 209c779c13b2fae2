"""A resumed Trainer run under the watch: its first learning rate and loss are judged against the checkpoint's
log. Real checkpoints written by a real Trainer (save_steps), resumed with trainer.train(resume_from_checkpoint=)."""
from __future__ import annotations

import pytest
from transformers import Trainer, TrainingArguments

import nbguard
from nbguard.testing import TinyDataset, tiny_llama


def _args(out, **overrides):
    settings = dict(output_dir=str(out), use_cpu=True, report_to=[], max_steps=8, per_device_train_batch_size=4,
                    learning_rate=1e-3, logging_steps=1, save_steps=4, save_strategy="steps", disable_tqdm=True,
                    lr_scheduler_type="linear", seed=0)
    settings.update(overrides)
    return TrainingArguments(**settings)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A run that trains 8 steps and saves at step 4: checkpoint-4 holds the optimizer and the log."""
    out = tmp_path_factory.mktemp("run")
    Trainer(model=tiny_llama(), args=_args(out), train_dataset=TinyDataset(64)).train()
    path = out / "checkpoint-4"
    assert (path / "optimizer.pt").is_file() and (path / "trainer_state.json").is_file()
    return out, path


def _resume(out, path, **overrides):
    trainer = Trainer(model=tiny_llama(), args=_args(out, **overrides), train_dataset=TinyDataset(64))
    with nbguard.watch(trainer, verify=False) as watch:
        trainer.train(resume_from_checkpoint=str(path))
    return trainer, [e for e in watch.events if e.kind == "resume-jump"]


def test_a_faithful_resume_continues_quietly(checkpoint):
    out, path = checkpoint
    trainer, events = _resume(out, path)
    assert events == [] and trainer.state.global_step == 8


def test_a_resume_with_a_changed_schedule_is_one_event_naming_both_rates(checkpoint):
    """max_steps 8 -> 20: the scheduler's lambdas are rebuilt from the new arguments while its step comes from
    scheduler.pt, so the linear decay jumps back up at the resume step."""
    out, path = checkpoint
    trainer, events = _resume(out, path, max_steps=20)
    [event] = events
    assert event.evidence["resumed_at_step"] == 4
    logged = {e["step"]: e["learning_rate"] for e in trainer.state.log_history if "learning_rate" in e}
    # the first resumed step still runs at the checkpoint's rate; the rebuilt schedule shows from the next
    assert event.evidence["checkpoint_learning_rate"] == logged[4] and event.evidence["step"] == 6
    assert event.evidence["learning_rate"] == logged[6] > logged[5]
    assert event.evidence["learning_rate"] > 1.4 * event.evidence["expected_learning_rate"]
    assert "the scheduler was rebuilt from changed arguments" in event.message


def test_a_changed_learning_rate_argument_that_the_scheduler_state_overrides_is_quiet(checkpoint):
    """learning_rate=1e-2 on resume: scheduler.pt brings the checkpoint's base rate back, so the run continues
    at the checkpoint's schedule; nbguard says nothing, because nothing jumped."""
    out, path = checkpoint
    trainer, events = _resume(out, path, learning_rate=1e-2)
    logged = {e["step"]: e["learning_rate"] for e in trainer.state.log_history if "learning_rate" in e}
    assert logged[5] < logged[4] < 1e-3 and events == []


def test_a_resume_whose_first_loss_jumps_is_one_event(tmp_path):
    """A run that memorised its rows resumes on other rows (the data changed under the same output_dir): the first
    loss is several times the checkpoint's; the event names both."""
    kw = dict(learning_rate=1e-2, max_steps=40, save_steps=30, lr_scheduler_type="constant")
    Trainer(model=tiny_llama(), args=_args(tmp_path, **kw), train_dataset=TinyDataset(4)).train()
    trainer = Trainer(model=tiny_llama(), args=_args(tmp_path, **kw), train_dataset=TinyDataset(4, seed=7))
    with nbguard.watch(trainer, verify=False) as watch:
        trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-30"))
    [event] = [e for e in watch.events if e.kind == "resume-jump"]
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert event.evidence["loss"] == losses[30] and event.evidence["checkpoint_losses"] == losses[25:30]
    assert losses[30] > 1.5 * sorted(losses[25:30])[2]
