"""Issue 45: a CPU full fine-tune above ``SAMPLE_ABOVE`` trainable elements reads 1/k of each weight's rows
per step for its update norms (runs of rows spread over it, other runs each step); every step is still read
and judged. Here the tiny Llama stands in for it: ``GATHER_BELOW=0`` (the per-tensor path) and ``SAMPLE_ABOVE`` set so that k is 3."""
from __future__ import annotations

import math

import pytest
import torch

import nbguard
from nbguard.testing import tiny_batch, tiny_llama
from nbguard.watcher.components import update_norms
from nbguard.watcher.components.update_norms import UpdateNorms

torch.set_num_threads(1)
PARTS = 3


@pytest.fixture
def sampled(monkeypatch):
    """The tiny Llama's update norms on the sampled path, with k = PARTS."""
    monkeypatch.setattr(update_norms, "GATHER_BELOW", 0)
    elements = sum(p.numel() for p in tiny_llama().parameters())
    monkeypatch.setattr(update_norms, "SAMPLE_ABOVE", -(-elements // PARTS))


def _sampled_rows(p: torch.Tensor, phase: int) -> torch.Tensor:
    """The rows step ``phase`` reads: the weight's rows cut into PARTS x SPREAD runs, runs phase::PARTS."""
    rows = p.detach().view(p.shape[0] if p.dim() else 1, -1)
    return torch.cat(rows.tensor_split(PARTS * update_norms.SPREAD)[phase::PARTS]).double()


def _sampled_total(before: dict[str, torch.Tensor], model, phase: int) -> float:
    """||Δw|| / ||w|| over the rows step ``phase`` reads of every weight, in float64."""
    delta = weight = 0.0
    for name, p in model.named_parameters():
        after = _sampled_rows(p, phase)
        delta += float((after - _sampled_rows(before[name], phase)).pow(2).sum())
        weight += float(after.pow(2).sum())
    return math.sqrt(delta / weight)


def test_each_step_reads_its_rows_of_every_weight(sampled):
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    expected = []
    with nbguard.watch(model, optimizer=opt, verify=False) as watch:
        for step in range(2 * PARTS):
            model(**tiny_batch(seed=step)).loss.backward()
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            opt.step()
            expected.append(_sampled_total(before, model, step % PARTS))
            opt.zero_grad(set_to_none=True)
        (reader,) = [d for d in watch.detectors if isinstance(d, UpdateNorms)]
        assert not reader._gather and len(reader._samples) == PARTS
        # PARTS steps read every weight once, each row in one of them
        read = sum(b.numel() for sample in reader._samples for b in sample.rows)
        assert read == sum(p.numel() for p in model.parameters())
    assert watch.history.steps == list(range(2 * PARTS))
    assert watch.history.total_update_norm == pytest.approx(expected, rel=1e-4)
    # every group has a ratio every step: each weight gives rows to every sample
    for group in watch.history.groups:
        assert all(v is not None and v > 0 for v in watch.history.update_norm(group)), group


def test_an_lr_jump_is_still_an_update_spike_in_its_own_step(sampled):
    """The same LR x1000 for steps 20-22 as tests/test_update_norms.py: caught at step 20, in whichever sample."""
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with nbguard.watch(model, optimizer=opt, verify=False) as watch:
        for step in range(30):
            for group in opt.param_groups:
                group["lr"] = 1.0 if 20 <= step < 23 else 1e-3
            model(**tiny_batch()).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    spikes = [e for e in watch.events if e.kind == "update-spike"]
    assert [e.step for e in spikes] == [20], [(e.kind, e.step) for e in watch.events]


def test_a_healthy_run_with_fresh_batches_stays_quiet(sampled):
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    with nbguard.watch(model, optimizer=opt, verify=False) as watch:
        for step in range(40):
            model(**tiny_batch(batch_size=4, seed=step)).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    assert watch.events == []
    assert all(v is not None for v in watch.history.total_update_norm)
