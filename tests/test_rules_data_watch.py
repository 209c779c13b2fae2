"""Item 3 of issue 13, the watch part: a micro-batch whose loss is built on few supervised tokens."""
from __future__ import annotations

import json
import math

import pytest
import torch
from audit_helpers import make_args
from transformers import Trainer

import nbguard
from nbguard.findings import Event
from nbguard.testing import TinyDataset, tiny_batch, tiny_llama
from nbguard.watcher.detectors.supervision import FewTokensDetector, supervised_count


def few_kinds(watch):
    return [e for e in watch.events if e.kind == "few-supervised-tokens"]


def train_loop(steps: int, few_at: tuple[int, ...] = (), kept: int = 2):
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    with nbguard.watch(model, optimizer=opt) as watch:
        for step in range(steps):
            batch = tiny_batch(2, 16, seed=step)
            if step in few_at:  # a mostly-prompt batch: only `kept` labels survive
                labels = torch.full_like(batch["labels"], -100)
                labels[0, -kept:] = batch["input_ids"][0, -kept:]
                batch["labels"] = labels
            loss = model(**batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    return watch, losses


def test_a_few_token_micro_batch_is_reported_once_then_counted():
    watch, losses = train_loop(16, few_at=(10, 13))
    assert all(math.isfinite(x) for x in losses)  # nothing non-finite: only the count tells
    [event] = few_kinds(watch)
    assert event.step == 10 and event.evidence["supervised_tokens"] == 2 and event.evidence["recent_median"] == 30
    assert event.evidence["occurrences"] == 2 and event.evidence["steps"] == [10, 13]
    assert "built on 2 supervised token(s)" in event.message
    again = Event.from_dict(event.to_dict())
    assert again.kind == "few-supervised-tokens" and again.evidence["steps"] == [10, 13]


def test_full_batches_and_early_steps_are_not_reported():
    watch, _ = train_loop(16)
    assert few_kinds(watch) == []
    early, _ = train_loop(4, few_at=(2,))  # 2 of 30 tokens, but no history yet to call it few
    assert few_kinds(early) == []


class EmptyRowsDataset(TinyDataset):
    """Rows 1 and 5 lost every label (a completion cut away by truncation)."""

    def __init__(self):
        super().__init__(8, 16)
        for i in (1, 5):
            self.rows[i] = {**self.rows[i], "labels": torch.full((16,), -100)}


def test_trainer_micro_batch_with_no_tokens_under_num_items_in_batch(tmp_path):
    # One row per micro-batch, two micro-batches per step: the Trainer passes num_items_in_batch, so the empty
    # micro-batch's loss is a finite 0 and the step silently trains on half the data.
    args = make_args(tmp_path, per_device_train_batch_size=1, gradient_accumulation_steps=2, max_steps=4)
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=EmptyRowsDataset())
    watch = nbguard.watch(trainer)
    trainer.train()
    assert [e.kind for e in watch.events if e.kind.startswith("nonfinite")] == []
    [event] = few_kinds(watch)
    assert event.evidence["supervised_tokens"] == 0 and event.evidence["occurrences"] >= 1
    assert sorted(event.evidence["step_counts"]) in ([0, 15], [0, 0])

    clean = Trainer(model=tiny_llama(), args=make_args(tmp_path / "clean", per_device_train_batch_size=1,
                                                       gradient_accumulation_steps=2, max_steps=4),
                    train_dataset=TinyDataset(8, 16))
    clean_watch = nbguard.watch(clean)
    clean.train()
    assert few_kinds(clean_watch) == []


def test_counts_come_from_the_trainers_labels_when_compute_loss_func_pops_them(tmp_path):
    def token_sum_loss(outputs, labels, num_items_in_batch=None):
        logits, targets = outputs.logits[:, :-1].float(), labels[:, 1:]
        loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, ignore_index=-100, reduction="sum")
        return loss / num_items_in_batch

    args = make_args(tmp_path, per_device_train_batch_size=1, gradient_accumulation_steps=2, max_steps=4)
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=EmptyRowsDataset(), compute_loss_func=token_sum_loss)
    watch = nbguard.watch(trainer)
    trainer.train()
    [event] = few_kinds(watch)  # the model never saw the labels: the Trainer's own were counted
    assert event.evidence["supervised_tokens"] == 0


def test_counts_follow_the_causal_shift_and_skip_non_token_labels():
    labels = torch.tensor([[5, -100, 7, 8], [-100, -100, -100, 9]])
    assert int(supervised_count(labels)) == 3  # the first label of each row is never predicted
    assert int(supervised_count(torch.tensor([[11], [11]]))) == 0  # one-token rows: nothing left to predict
    detector = FewTokensDetector()
    detector.capture(0, torch.zeros(4))  # regression targets: nothing to count
    detector.capture(1, None)
    assert detector.pending() == [] and detector.update(None) is None
    detector.capture(2, labels)
    [count] = detector.pending()
    assert count.shape == () and detector.update([0.0]) == {"micro_batch": 2, "supervised_tokens": 0,
                                                           "recent_median": None, "step_counts": [0]}


def test_the_event_reaches_every_document_view():
    from nbguard.render import render_text

    watch, _ = train_loop(16, few_at=(10,))
    doc = watch.to_document()
    [event] = [e for e in doc["events"] if e["kind"] == "few-supervised-tokens"]
    assert event["evidence"]["supervised_tokens"] == 2
    assert "few-supervised-tokens" in render_text(doc) and "built on 2 supervised token(s)" in render_text(doc)
    jsonschema = pytest.importorskip("jsonschema")
    from nbguard.reporting import build_report, schema

    jsonschema.Draft202012Validator(schema()).validate(json.loads(json.dumps(build_report(watch=watch).to_dict())))


def test_a_run_of_one_token_rows_is_reported_as_training_on_no_tokens(tmp_path):
    """Issue 43 item 3 (c): a word-level tokenizer reloaded as Qwen2Tokenizer encodes every text to []; TRL's SFT rows
    are its EOS alone, the loss and grad norm are 0 every step. The count follows the causal shift: 0 tokens."""
    pytest.importorskip("trl")
    from tokenizer_helpers import sft_on_text, word_level_beside_qwen2
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(word_level_beside_qwen2(tmp_path / "tok"))
    tok.pad_token = "<pad>"
    trainer = sft_on_text(tok, tmp_path / "out", max_steps=3, logging_steps=1, per_device_train_batch_size=2)
    watch = nbguard.watch(trainer)
    trainer.train()
    assert [(row["loss"], row["grad_norm"]) for row in trainer.state.log_history[:3]] == [(0.0, 0.0)] * 3
    [event] = few_kinds(watch)
    assert event.step == 0 and event.evidence["supervised_tokens"] == 0
    assert event.evidence["occurrences"] == 3 and event.evidence["steps"] == [0, 1, 2]
    watch.detach()
