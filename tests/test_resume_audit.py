"""nbguard.audit(trainer=..., resume_from_checkpoint=PATH) on checkpoints a real Trainer run wrote (save_steps):
flagged before trainer.train(resume_from_checkpoint=PATH) runs."""
from __future__ import annotations

import os
import warnings

import pytest

import nbguard
from nbguard.testing import TinyDataset, tiny_llama

pytestmark = pytest.mark.filterwarnings("ignore")
RESUME_RULES = {"resume-checkpoint-incomplete", "resume-batch-changed", "resume-lr-jump"}


def trainer_for(out, **overrides):
    from transformers import Trainer, TrainingArguments

    options = dict(output_dir=str(out), use_cpu=True, report_to=[], save_strategy="steps", save_steps=2, max_steps=4,
                   per_device_train_batch_size=4, logging_steps=1, disable_tqdm=True, learning_rate=1e-3)
    options.update(overrides)
    return Trainer(model=tiny_llama(), args=TrainingArguments(**options), train_dataset=TinyDataset(16, 16))


@pytest.fixture
def checkpoint(tmp_path):
    trainer = trainer_for(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    return tmp_path / "checkpoint-2"


def resume_rules(result) -> set[str]:
    return {f.rule for f in result.findings} & RESUME_RULES


def test_an_intact_checkpoint_with_the_same_arguments_is_quiet(tmp_path, checkpoint):
    result = nbguard.audit(trainer=trainer_for(tmp_path), resume_from_checkpoint=str(checkpoint))
    assert resume_rules(result) == set()
    assert nbguard.audit(trainer=trainer_for(tmp_path), resume_from_checkpoint=True).finding(
        "resume-checkpoint-incomplete") is None  # True: the last checkpoint in output_dir, as the Trainer reads it


def test_a_checkpoint_without_optimizer_pt_is_flagged_before_training(tmp_path, checkpoint):
    os.remove(checkpoint / "optimizer.pt")
    result = nbguard.audit(trainer=trainer_for(tmp_path), resume_from_checkpoint=str(checkpoint))
    f = result.finding("resume-checkpoint-incomplete")
    assert f is not None and "optimizer.pt" in f.title and "fresh AdamW moments" in f.detail
    assert f.evidence["missing"] == ["optimizer.pt"]
    assert resume_rules(result) == {"resume-checkpoint-incomplete"}


def test_a_truncated_scheduler_is_flagged_as_unloadable(tmp_path, checkpoint):
    data = (checkpoint / "scheduler.pt").read_bytes()
    (checkpoint / "scheduler.pt").write_bytes(data[: len(data) // 2])  # a save cut off by a full disk
    f = nbguard.audit(trainer=trainer_for(tmp_path), resume_from_checkpoint=str(checkpoint)).finding(
        "resume-checkpoint-incomplete")
    assert f is not None and "scheduler.pt" in f.evidence["unreadable"]


def test_a_changed_batch_size_is_flagged(tmp_path, checkpoint):
    result = nbguard.audit(trainer=trainer_for(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=2),
                           resume_from_checkpoint=str(checkpoint))
    f = result.finding("resume-batch-changed")
    assert f is not None
    assert f.evidence["changed"] == {"per_device_train_batch_size": [4, 2], "gradient_accumulation_steps": [1, 2]}


def test_a_longer_schedule_makes_the_learning_rate_jump(tmp_path, checkpoint):
    result = nbguard.audit(trainer=trainer_for(tmp_path, max_steps=20), resume_from_checkpoint=str(checkpoint))
    f = result.finding("resume-lr-jump")
    assert f is not None
    # linear decay: after 2 of 4 steps the run was at half the peak; rebuilt for 20 steps it is at 90%
    assert f.evidence["checkpoint_lr"] == pytest.approx(5e-4) and f.evidence["resumed_lr"] == pytest.approx(9e-4)
    assert "max_steps is 20 now, 4 in the checkpoint" in f.detail


def test_bad_checkpoint_arguments_say_what_to_pass(tmp_path):
    trainer = trainer_for(tmp_path)
    with pytest.raises(ValueError, match="does not exist"):
        nbguard.audit(trainer=trainer, resume_from_checkpoint=str(tmp_path / "checkpoint-9"))
    with pytest.raises(ValueError, match="has no checkpoint-"):
        nbguard.audit(trainer=trainer, resume_from_checkpoint=True)
    with pytest.raises(TypeError, match="must be a checkpoint folder"):
        nbguard.audit(trainer=trainer, resume_from_checkpoint=3)
