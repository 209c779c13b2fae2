"""The watch's loss is the loss the Trainer trains on and logs, not the model's by-product.

TRL's GRPO and DPO trainers pass labels to the model for its log-probabilities, so the model also
returns a language-model loss (about ln(vocab) on a fresh model) that is not what is backpropagated.
Each step's loss in the watch's history must equal the Trainer's logged loss (logging_steps=1).
"""
from __future__ import annotations

import math

import pytest
from rl_helpers import dpo_trainer, grpo_trainer

import nbguard
from nbguard.testing import TinyDataset, tiny_llama


def logged_losses(trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def assert_watch_loss_is_the_logged_loss(trainer, watch) -> None:
    logged = logged_losses(trainer)
    assert len(logged) == watch.step == trainer.state.global_step
    assert watch.history.loss == pytest.approx(logged, rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("make", [grpo_trainer, dpo_trainer], ids=["grpo", "dpo"])
def test_a_trl_trainers_loss_is_its_own(tmp_path, make):
    trainer = make(tmp_path)
    watch = nbguard.watch(trainer)
    trainer.train()
    assert_watch_loss_is_the_logged_loss(trainer, watch)
    # the model's own language-model loss on the tiny vocabulary is near ln(128); the trainers' are not
    assert all(abs(loss - math.log(128)) > 1.0 for loss in watch.history.loss)


def test_equal_rewards_leave_a_zero_loss_in_the_watch(tmp_path):
    trainer = grpo_trainer(tmp_path, reward_funcs=lambda completions, **kw: [1.0] * len(completions))
    watch = nbguard.watch(trainer)
    trainer.train()
    assert watch.history.loss == [0.0] * trainer.state.global_step == logged_losses(trainer)
    assert [e.kind for e in watch.events] == ["no-learning-signal"]


def test_a_users_compute_loss_with_accumulation_is_what_the_watch_reads(tmp_path):
    from transformers import Trainer, TrainingArguments

    class ThirdLoss(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            outputs = model(**inputs)
            return (outputs.loss / 3, outputs) if return_outputs else outputs.loss / 3

    args = TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, logging_steps=1, use_cpu=True, report_to=[],
                             save_strategy="no", disable_tqdm=True)
    trainer = ThirdLoss(model=tiny_llama(), args=args, train_dataset=TinyDataset(16))
    watch = nbguard.watch(trainer)
    trainer.train()
    assert_watch_loss_is_the_logged_loss(trainer, watch)
    watch.detach()
    assert "training_step" not in vars(trainer)  # the tap left with the watch


def test_a_plain_trainer_keeps_reading_its_models_loss(tmp_path):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, logging_steps=1, use_cpu=True, report_to=[],
                             save_strategy="no", disable_tqdm=True)
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=TinyDataset(16))
    watch = nbguard.watch(trainer)
    assert "training_step" not in vars(trainer)
    trainer.train()
    assert_watch_loss_is_the_logged_loss(trainer, watch)


def test_sft_with_accumulation_keeps_every_micro_batch(tmp_path):
    """TRL's SFTTrainer takes its loss from the model's log-probabilities, not the model's own loss: the
    backward through them must count as the micro-batch's backward, or the next forward would drop it."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from nbguard.testing import word_tokenizer

    rows = [{"prompt": f"w{3 + i % 50} w{9 + i % 40}", "completion": f" w{20 + i % 60} w{30 + i % 70} w{4 + i % 90}"}
            for i in range(32)]
    args = SFTConfig(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                     logging_steps=1, use_cpu=True, report_to="none", save_strategy="no", disable_tqdm=True)
    trainer = SFTTrainer(model=tiny_llama(), args=args, train_dataset=Dataset.from_list(rows),
                         processing_class=word_tokenizer())
    watch = nbguard.watch(trainer)
    trainer.train()
    assert_watch_loss_is_the_logged_loss(trainer, watch)
