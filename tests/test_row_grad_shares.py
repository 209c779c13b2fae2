"""Issue 32 item 2: an exploded step's rows, each with its share of the gradient norm, on real runs.

A tiny Llama memorises one row repeated through a DataLoader (its gradient norm falls three decades);
one row in the dataset has random labels. Its step explodes: the event names that row by dataset index
with nearly all of the gradient, and, since the last snapshot's weights do no better on that batch, the
weights are as good as before: under rewind the update is dropped and nothing is thrown away.
"""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

import nbguard
from nbguard.step.capture import MicroBatch, capture_rng
from nbguard.testing import tiny_batch, tiny_llama, word_tokenizer
from nbguard.watcher import RewindSettings
from nbguard.watcher.localise.row_grads import row_grad_shares
from nbguard.watcher.localise.rows import bad_row_indices

torch.set_num_threads(1)

POISONED, ROWS, BATCH = 181, 200, 4


def _rows(poisoned: bool = True) -> list[dict[str, torch.Tensor]]:
    one = tiny_batch(1, 16, seed=0)
    rows = [{k: v[0].clone() for k, v in one.items()} for _ in range(ROWS)]
    if poisoned:
        rows[POISONED]["labels"] = torch.randint(3, 128, (16,), generator=torch.Generator().manual_seed(1))
    return rows


def _run(policy: str, poisoned: bool = True, **rewind):
    loader = DataLoader(_rows(poisoned), batch_size=BATCH, shuffle=False)
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    watch = nbguard.watch(model, optimizer=opt, policy=policy, verify=False, rewind=RewindSettings(**rewind))
    watch.track_rows(loader, tokenizer=word_tokenizer())
    losses = []
    for batch in loader:
        opt.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    watch.detach()
    return watch, losses


def test_the_row_that_pulled_the_exploded_step_is_named_with_its_share_and_nothing_is_rewound():
    watch, losses = _run("rewind")
    [event] = watch.events
    step = POISONED // BATCH
    assert event.kind == "divergence" and event.step == step
    rows = event.evidence["rows"]
    top = rows["rows"][0]
    assert top["dataset_index"] == POISONED and top["grad_share"] > 0.95
    # its text, decoded by the tokenizer given to track_rows (the row's tokens: all 16 are attended)
    excerpt = " ".join(word_tokenizer().decode(_rows()[POISONED]["input_ids"].tolist()).split())
    assert top["excerpt"] == excerpt and excerpt.startswith("w")
    assert f'dataset index {POISONED} ("{excerpt[:60]}' in event.message and " pulled " in event.message
    assert rows["rows_checked"] == BATCH and bad_row_indices(event) == [POISONED] and rows["fix"] == "drop-rows"
    # the snapshot's weights do no better on this batch: the batch exploded, not the weights; dropped, not rewound
    assert event.evidence["damage_check"]["damaged"] is False
    assert event.evidence["rewind"]["restored"] is False and "the batch exploded" in event.evidence["rewind"]["reason"]
    assert watch.history.skipped_steps == [step]
    assert losses[step + 1] < 2 * losses[step - 1]  # the next step trains on from the memorised state


def test_shares_sum_to_one_and_follow_the_rows_gradients():
    """One batch holding the off row: the shares are the rows' gradient norms over their sum, read against
    torch's own backward of each row alone."""
    model = tiny_llama()
    rows = _rows()
    batch = {k: torch.stack([r[k] for r in rows[180:184]]) for k in rows[0]}

    mb = MicroBatch(index=0, args=(), kwargs=batch, rng=capture_rng(), autocast=[])  # fp32, as captured
    shares, why_not = row_grad_shares(model, [mb])
    assert why_not is None and sum(shares.values()) == pytest.approx(1.0)
    norms = []
    for r in range(4):
        model.zero_grad()
        out = model(**{k: v[r:r + 1] for k, v in batch.items() if k != "labels"})
        logits, labels = out.logits[:, :-1], batch["labels"][r:r + 1, 1:]
        torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                          ignore_index=-100, reduction="sum").backward()
        norms.append(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()
                                                           if p.grad is not None])).item())
    for r in range(4):
        assert shares[(0, r)] == pytest.approx(norms[r] / sum(norms), rel=1e-3)
    assert max(shares, key=shares.get) == (0, POISONED - 180)


def test_a_bad_batch_does_not_stop_a_run_that_has_no_rewinds_left():
    """With no rewinds allowed, trouble that needs one stops training; a bad batch does not need one."""
    watch, losses = _run("rewind", max_rewinds=0)
    assert len(losses) == ROWS // BATCH  # every batch trained on
    assert [e.kind for e in watch.events] == ["divergence"] and watch.events[0].evidence["damage_check"]["damaged"] is False


def test_rows_stay_named_by_loss_when_their_gradients_cannot_be_taken(monkeypatch):
    """A model whose per-row backward fails (here: autograd.grad raising) keeps the rows and their losses."""
    def refuse(*args, **kwargs):
        raise RuntimeError("planted: no per-row backward")

    monkeypatch.setattr(torch.autograd, "grad", refuse)
    watch, _ = _run("rewind")
    [event] = [e for e in watch.events if e.kind == "divergence"]
    rows = event.evidence["rows"]
    assert "rows_error" not in event.evidence and rows["rows_checked"] == BATCH
    assert rows["grad_shares_unknown"] == "RuntimeError: planted: no per-row backward"
    assert rows["rows"][0]["dataset_index"] == POISONED  # the highest loss, still first
