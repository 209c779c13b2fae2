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

