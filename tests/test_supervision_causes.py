"""Runs whose loss scores no token: the event names that cause, and offers the fix that fits the run.

Rows of one token (TRL's EOS alone, where a tokenizer encoded the text to nothing) score nothing: the causal
loss shifts each row's labels by one. A plain loop's mean over no token is 0/0 = NaN; a Trainer's loss over
``num_items_in_batch`` = 0 is 0 with a zero gradient, a dead run whose cause is the data, not the learning rate.
"""
from __future__ import annotations

import pytest
import torch
from watch_helpers import train

import nbguard
from nbguard.document.view import recommended_fix, view
from nbguard.step.capture import supervised_mask
from nbguard.testing import tiny_batch, tiny_llama

torch.set_num_threads(1)


def one_token_rows(rows: int = 2, seed: int = 0) -> dict:
    """A batch whose every row is one token, its label the token itself (unshifted, as a collator makes it)."""
    batch = tiny_batch(rows, 1, seed=seed)
    batch["labels"] = batch["input_ids"].clone()
    return batch


def test_one_token_rows_keep_no_supervised_label():
    assert supervised_mask(torch.tensor([[11], [12]])).shape == (2, 0)  # nothing left after the shift
    assert supervised_mask(torch.tensor([[5, -100, 7], [-100, -100, 9]])).tolist() == [[False, True], [False, True]]
    assert supervised_mask(torch.tensor([4, 5, -100])).tolist() == [[True, False]]  # one sequence, no batch dim


def test_a_nonfinite_step_on_one_token_rows_is_no_supervised_tokens():
    model = tiny_llama()
    data = [tiny_batch(2, 12, seed=0), one_token_rows(seed=1)]
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with nbguard.watch(model, optimizer=opt, policy="skip") as watch:
        losses = train(model, opt, data)
    assert torch.isnan(losses[1])  # the model's own loss: a mean over no scored token
    [event] = [e for e in watch.events if e.kind.startswith("nonfinite")]
    assert (event.kind, event.step, event.cause) == ("nonfinite-loss", 1, "no-supervised-tokens")
    assert event.origins == [] and event.evidence["micro_batches_without_labels"] == [0]



# ---- the supervision fix fits the run: a Trainer's data, never a plain loop's ---------------------------
def event_fixes(watch, kind: str) -> tuple[list[str], str | None]:
    """The fixes the card of ``watch``'s ``kind`` event shows, and the one every face recommends."""
    card = next(c for s in view(watch.to_document()).sections if s.kind == "watch" for c in s.cards if c.tag == kind)
    best = recommended_fix(card.fixes)
    return [f.id for f in card.fixes], best.id if best is not None else None


def test_a_plain_loop_is_not_offered_the_trainers_data_fix():
    """drop-unsupervised-rows filters trainer.train_dataset: a loop has no Trainer for its action or its cell."""
    model = tiny_llama()
    data = [tiny_batch(2, 12, seed=0), tiny_batch(2, 12, seed=1)]
    data[1]["labels"][:] = -100  # the second micro-batch's mean is 0/0
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with nbguard.watch(model, optimizer=opt, policy="skip") as watch:
        train(model, opt, data, accumulation=2)
    [event] = watch.events
    assert event.cause == "no-supervised-tokens" and "verification_error" not in event.evidence
    assert "drop-unsupervised-rows" not in [v.fix for v in watch.verification.verdicts]
    fixes, best = event_fixes(watch, "nonfinite-loss")
    assert "drop-unsupervised-rows" not in fixes and best is None
    assert not any("trainer" in (v.code or "") for v in watch.verification.verdicts)


def test_a_trainer_run_is_offered_the_data_fix_with_its_cell(tmp_path):
    from audit_helpers import make_args, make_trainer

    trainer = make_trainer(tiny_llama(), make_args(tmp_path, per_device_train_batch_size=2, max_steps=1), rows=2)
    for row in trainer.train_dataset.rows:  # the step's rows: nothing supervised, a 0/0 loss
        row["labels"][:] = -100
    watch = nbguard.watch(trainer, policy="skip")
    trainer.train()
    watch.detach()
    [event] = watch.events
    assert (event.step, event.cause) == (0, "no-supervised-tokens")
    verdict = watch.verification.verdict("drop-unsupervised-rows")
    # offered and run: every row of the step goes, so it is not enough there, and its cell filters the Trainer's data
    assert verdict.verdict == "not enough" and "trainer.train_dataset.filter" in verdict.code
    fixes, _ = event_fixes(watch, "nonfinite-loss")
    assert fixes[0] == "drop-unsupervised-rows"


# ---- a dead run's fix follows its cause ------------------------------------------------------------------
def test_a_dead_sft_run_on_eos_only_rows_recommends_the_supervision_fix(tmp_path):
    """A word-level tokenizer reloaded as Qwen2Tokenizer encodes every text to []: TRL's rows are EOS alone, the
    loss and the gradient are 0 on every step. The run is dead for want of labels, not for its learning rate."""
    pytest.importorskip("trl")
    from tokenizer_helpers import sft_on_text, word_level_beside_qwen2
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(word_level_beside_qwen2(tmp_path / "tok"))
    tok.pad_token = "<pad>"
    trainer = sft_on_text(tok, tmp_path / "out", max_steps=5, logging_steps=1, per_device_train_batch_size=2)
    watch = nbguard.watch(trainer, verify=False)
    trainer.train()
    watch.detach()
    assert {row["input_ids"] == [tok.eos_token_id] for row in trainer.train_dataset} == {True}  # EOS alone
    [dead] = [e for e in watch.events if e.kind == "dead-run"]
    assert dead.evidence["zero_gradient"] and dead.cause == "no-supervised-tokens"
    assert dead.evidence["supervised_tokens"] == 0 and "nothing to learn" in dead.message
    assert dead.evidence["fixes"] == ["drop-unsupervised-rows"]
    fixes, best = event_fixes(watch, "dead-run")
    assert fixes == ["drop-unsupervised-rows"] and best == "drop-unsupervised-rows"
    # the run's first event (what the report's summary leads with) offers the same fix
    [few] = [e for e in watch.events if e.kind == "few-supervised-tokens"]
    assert few.step == 0 and few.evidence["supervised_tokens"] == 0
    assert few.evidence["fixes"] == ["drop-unsupervised-rows"]


def test_a_dead_run_with_supervised_tokens_keeps_its_learning_rate_fix(tmp_path):
    """TRL's SFT at learning rate 1000: one exploded step, then flat logits and a zero gradient on rows whose
    labels the loss scores. Its cause is the learning rate."""
    pytest.importorskip("trl")
    from test_divergence import sft_trainer

    trainer = sft_trainer(tmp_path, learning_rate=1000.0, steps=6)
    watch = nbguard.watch(trainer, verify=False)
    trainer.train()
    watch.detach()
    [dead] = [e for e in watch.events if e.kind == "dead-run"]
    assert dead.cause is None and "supervised_tokens" not in dead.evidence
    fixes, best = event_fixes(watch, "dead-run")
    assert fixes == ["lower-learning-rate", "add-warmup", "enable-grad-clipping"] and best == "lower-learning-rate"


def test_the_watchs_supervision_fixes_are_those_the_cause_offers():
    """The watch names the fix ids without importing the fix registry: they must be the ones its ``treats`` give."""
    from nbguard.verifier import CAUSE_FIXES
    from nbguard.watcher.detectors.supervision import supervision_fixes

    assert supervision_fixes(trainer=object()) == CAUSE_FIXES["no-supervised-tokens"]
    assert supervision_fixes(trainer=None) == []  # a plain loop: no Trainer data to filter
