"""Issue 45, follow-up: sampled update norms say they are estimates, and the update-norm budget counts what each
path really holds.

A CPU run above ``SAMPLE_ABOVE`` trainable elements reads 1/k of each weight's rows per step: its history, its
document (and so the JSON, HTML and Markdown reports) and an ``update-spike`` quoting a sampled ratio say so; a
run under the threshold says nothing of the kind. The budget (``WatchSettings.update_norm_budget_mb``) counts
two flat copies on the gathered path, one on the per-tensor path and one sample's rows on the sampled path.

The model is a real Llama from a config, 1.38M parameters (5.3 MiB of fp32) in 21 tensors: large tensors, so the
per-tensor path, under the real threshold; ``SAMPLE_ABOVE`` is lowered so that k is 3 where a test samples."""
from __future__ import annotations

import html

import pytest
import torch

import nbguard
from nbguard.document.schema import schema
from nbguard.document.view import view
from nbguard.render import render_text
from nbguard.testing import tiny_batch, tiny_llama
from nbguard.watcher import NanWatch, WatchSettings
from nbguard.watcher.components import update_norms
from nbguard.watcher.components.update_norms import UpdateNorms, make_update_norms
from nbguard.watcher.core.registry import ComponentSetup

jsonschema = pytest.importorskip("jsonschema")
torch.set_num_threads(1)
PARTS = 3
MIB = 2 ** 20


def _model():
    return tiny_llama(hidden_size=256, intermediate_size=512, num_key_value_heads=4)


def _bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.fixture
def sampled(monkeypatch):
    """The model's update norms on the sampled path, with k = PARTS (the real path's choice, at a lower threshold)."""
    monkeypatch.setattr(update_norms, "SAMPLE_ABOVE", -(-sum(p.numel() for p in _model().parameters()) // PARTS))


def _run(steps: int, budget_mb: float | None = None, spike_at: int | None = None, before_step=None):
    """A real watched AdamW run of the model; the LR x1000 at ``spike_at``; ``before_step(step, model)`` each step."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    settings = WatchSettings() if budget_mb is None else WatchSettings(update_norm_budget_mb=budget_mb)
    with NanWatch(model, optimizer=opt, settings=settings).attach() as watch:
        for step in range(steps):
            if before_step is not None:
                before_step(step, model)
            for group in opt.param_groups:
                group["lr"] = 1.0 if step == spike_at else 1e-3
            model(**tiny_batch(seed=step)).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return watch


def _update_fact(doc: dict) -> str:
    (fact,) = [f.text for f in view(doc).section("watch").facts if f.text.startswith("update ‖Δw‖/‖w‖")]
    return fact


# ---- the mark -------------------------------------------------------------------------------------------------
def test_a_sampled_run_says_its_update_norms_are_estimates_and_its_spike_too(sampled):
    watch = _run(14, spike_at=12)
    assert watch.history.update_norm_sampled == {"parts": PARTS, "from_step": 0}
    (spike,) = [e for e in watch.events if e.kind == "update-spike"]
    assert spike.step == 12 and spike.evidence["sample_parts"] == PARTS
    assert spike.message.startswith(f"the optimizer's update (estimated from 1/{PARTS} of each weight's rows) jumped")
    doc = watch.to_document()
    jsonschema.Draft202012Validator(schema()).validate(doc)
    assert doc["history"]["update_norm_sampled"] == {"parts": PARTS, "from_step": 0}
    mark = f"(estimated from 1/{PARTS} of each weight's rows from step 0)"
    assert _update_fact(doc).startswith(f"update ‖Δw‖/‖w‖ {mark}: median ")
    report = nbguard.report(watch=watch)
    assert mark in html.unescape(report.to_html()) and mark in render_text(doc)
    (card,) = [c for c in view(doc).section("watch").cards if c.tag == "update-spike"]
    assert f"(estimated from 1/{PARTS} of each weight's rows)" in " ".join([card.title, *card.lines])  # its message


def test_a_run_under_the_threshold_says_nothing_of_estimates():
    watch = _run(14, spike_at=12)
    (reader,) = [d for d in watch.detectors if isinstance(d, UpdateNorms)]
    assert not reader._gather and len(reader._samples) == 1  # per tensor, every row
    assert watch.history.update_norm_sampled is None
    (spike,) = [e for e in watch.events if e.kind == "update-spike"]
    assert spike.step == 12 and "sample_parts" not in spike.evidence and "estimated" not in spike.message
    doc = watch.to_document()
    jsonschema.Draft202012Validator(schema()).validate(doc)
    assert "update_norm_sampled" not in doc["history"] and "total_update_norm" in doc["history"]
    assert "estimated" not in _update_fact(doc) and "estimated" not in html.unescape(nbguard.report(watch=watch).to_html())


def test_weights_replanned_over_the_threshold_mid_run_are_marked_from_that_step(monkeypatch):
    """New storage at step 3 (``p.data`` replaced: a load) re-plans the read, now over the threshold: the steps
    before were read whole, those from 3 on are estimates."""
    def replace_at_3(step: int, model) -> None:
        if step == 3:
            monkeypatch.setattr(update_norms, "SAMPLE_ABOVE", -(-sum(p.numel() for p in model.parameters()) // PARTS))
            for p in model.parameters():
                p.data = p.data.clone()

    watch = _run(6, before_step=replace_at_3)
    assert watch.history.update_norm_sampled == {"parts": PARTS, "from_step": 3}
    assert all(v is not None for v in watch.history.total_update_norm)
    doc = watch.to_document()
    jsonschema.Draft202012Validator(schema()).validate(doc)
    assert f"(estimated from 1/{PARTS} of each weight's rows from step 3)" in _update_fact(doc)


def test_the_schema_rejects_a_malformed_sampling_mark(sampled):
    doc = _run(2).to_document()
    check = jsonschema.Draft202012Validator(schema())
    check.validate(doc)
    for bad in ({"parts": "3", "from_step": 0}, {"parts": PARTS}, {**doc["history"]["update_norm_sampled"], "k": 3}):
        with pytest.raises(jsonschema.ValidationError):
            check.validate({**doc, "history": {**doc["history"], "update_norm_sampled": bad}})


# ---- the budget -----------------------------------------------------------------------------------------------
def test_the_per_tensor_path_fits_a_budget_between_one_copy_and_two():
    """One copy (5.3 MiB) fits 8 MiB; counted as two (10.5 MiB), as before, it did not."""
    assert _bytes(_model()) < 8 * MIB < 2 * _bytes(_model())
    watch = _run(3, budget_mb=8)
    assert watch.history.update_norm_unavailable is None
    assert all(v is not None and v > 0 for v in watch.history.total_update_norm)


def test_the_gathered_path_counts_its_two_copies_against_the_same_budget(monkeypatch):
    monkeypatch.setattr(update_norms, "GATHER_BELOW", 2 ** 40)  # gathered, as a LoRA's many small tensors are
    watch = _run(3, budget_mb=8)
    size = 2 * _bytes(_model()) / MIB
    assert watch.history.update_norm_unavailable == (
        f"two flat copies of the trainable weights (gathered per group) take {size:.1f} MiB, over the update-norm "
        f"budget of 8 MiB (WatchSettings(update_norm_budget_mb=...))")
    assert watch.history.total_update_norm == [None] * 3


def test_the_per_tensor_path_over_the_budget_says_it_holds_one_copy():
    watch = _run(2, budget_mb=4)
    assert watch.history.update_norm_unavailable == (
        f"one copy of the trainable weights (compared tensor by tensor) takes {_bytes(_model()) / MIB:.1f} MiB, over "
        f"the update-norm budget of 4 MiB (WatchSettings(update_norm_budget_mb=...))")
    assert watch.history.total_update_norm == [None] * 2


def test_the_sampled_path_counts_one_samples_rows(sampled):
    """k = 3: the copy holds the largest sample's rows, about a third of the weights (1.8 MiB): 4 MiB fits, where
    one whole copy (5.3 MiB) does not; 1 MiB does not."""
    watch = _run(3, budget_mb=4)
    (reader,) = [d for d in watch.detectors if isinstance(d, UpdateNorms)]
    assert reader._buffers is not None
    held = sum(b.numel() * b.element_size() for b in reader._buffers)
    assert held == max(sum(r.numel() for r in s.rows) for s in reader._samples) * 4
    assert _bytes(_model()) / PARTS <= held < 4 * MIB < _bytes(_model())
    assert watch.history.update_norm_unavailable is None and watch.history.update_norm_sampled is not None
    assert all(v is not None and v > 0 for v in watch.history.total_update_norm)
    over = _run(2, budget_mb=1)
    assert over.history.update_norm_unavailable == (
        f"a copy of 1/{PARTS} of each trainable weight's rows (the sampled CPU path) takes {held / MIB:.1f} MiB, "
        f"over the update-norm budget of 1 MiB (WatchSettings(update_norm_budget_mb=...))")
    assert over.history.update_norm_sampled is None


def test_the_budgets_default_has_one_source():
    """The component takes its budget from WatchSettings: a watch's own, or its default where a setup has none."""
    watch = _run(1)
    setup = ComponentSetup(None, "warn", reads=watch._collector, history=watch.history)
    made = make_update_norms(setup)
    assert made is not None and made.budget_bytes == int(WatchSettings().update_norm_budget_mb * MIB)
    assert made.budget_bytes == next(d for d in watch.detectors if isinstance(d, UpdateNorms)).budget_bytes
    assert make_update_norms(ComponentSetup(None, "warn", thresholds=WatchSettings(update_norms=False))) is None
