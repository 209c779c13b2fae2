"""Dropout left in eval mode under a wrapper whose train() sets only its own flag: a real Trainer step."""
from __future__ import annotations

import pytest
import torch
from audit_helpers import make_args
from data_helpers import ListDataset, ragged_examples, word_tokenizer

import nbguard
from nbguard.testing import tiny_llama
from nbguard.watcher.detectors.train_mode import DropoutModeCheck


class OwnFlagWrapper(torch.nn.Module):
    """A wrapper whose train() sets only its own flag (as wrappers that keep a backbone's mode do)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.config = inner.config

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, labels=labels, **kwargs)

    def train(self, mode: bool = True):
        self.training = mode
        return self


def wrapped(dropout: float = 0.3):
    inner = tiny_llama(attention_dropout=dropout)
    return OwnFlagWrapper(inner)


def two_losses(model) -> tuple[float, float]:
    batch = {"input_ids": torch.arange(3, 19)[None], "labels": torch.arange(3, 19)[None]}
    with torch.no_grad():
        return float(model(**batch).loss), float(model(**batch).loss)


def dropout_findings(model):
    return [f for f in nbguard.audit(model).findings if f.rule == "dropout-off-in-training"]


def trainer_for(tmp_path, model, check):
    from transformers import DataCollatorForLanguageModeling, Trainer

    tok = word_tokenizer(pad="unk")
    return Trainer(model=model, args=make_args(tmp_path, max_steps=2), train_dataset=ListDataset(ragged_examples(8)),
                   data_collator=DataCollatorForLanguageModeling(tok, mlm=False), callbacks=[check])


def test_inner_eval_left_by_evaluation_trains_without_dropout_and_is_caught(tmp_path):
    model = wrapped()
    model.inner.eval()  # what an evaluation (or a sampling callback) left behind
    model.train()  # the Trainer's call each step: it reaches the wrapper's flag only
    first, second = two_losses(model)
    assert first == second  # no dropout: the "training" forward is deterministic
    (f,) = dropout_findings(model)
    assert f.evidence["dropout_in_eval"]["count"] == 2 and f.fixes == ["dropout-train-mode"]

    check = DropoutModeCheck()
    with pytest.warns(UserWarning, match="dropout layer"):
        trainer_for(tmp_path, model, check).train()
    assert [r["step"] for r in check.records] == [1, 2] and check.steps_with_dropout_off == 2

    assert nbguard.fixes.apply("dropout-train-mode", model=model).changed
    first, second = two_losses(model)
    assert first != second and not dropout_findings(model)


def test_healthy_model_in_training_stays_quiet(tmp_path):
    model = tiny_llama(attention_dropout=0.3)
    model.eval()
    model.train()
    assert not dropout_findings(model)
    check = DropoutModeCheck()
    trainer_for(tmp_path, model, check).train()
    assert check.records == []


def test_model_in_eval_mode_is_not_flagged():
    model = wrapped()
    model.inner.eval()
    model.eval()
    assert not dropout_findings(model)


def test_fix_cell_compiles():
    compile(nbguard.fixes.code("dropout-train-mode", model="policy"), "<cell>", "exec")
