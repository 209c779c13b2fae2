"""Issue 32 item 3: per-group update norms (||Δw|| / ||w|| of each optimizer step) in the history,
document, heatmap and trackers, and the ``update-spike`` early warning on real runs."""
from __future__ import annotations

import math
import statistics

import pytest
import torch

import nbguard
from nbguard.document.schema import schema
from nbguard.render import update_norms_png
from nbguard.testing import tiny_batch, tiny_llama
from nbguard.watcher import NanWatch, WatchSettings
from nbguard.watcher.components import update_norms
from nbguard.watcher.components.update_norms import UpdateNorms
from nbguard.watcher.reads.history import group_name

torch.set_num_threads(1)
jsonschema = pytest.importorskip("jsonschema")


def _weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _ratios(before: dict[str, torch.Tensor], model) -> tuple[dict[str, float], float]:
    """Per group and in all, ||w_after - w_before|| / ||w_after||, computed here in float64."""
    delta: dict[str, float] = {}
    weight: dict[str, float] = {}
    for name, p in model.named_parameters():
        if name not in before:
            continue
        g = group_name(name)
        delta[g] = delta.get(g, 0.0) + float((p.detach().double() - before[name].double()).pow(2).sum())
        weight[g] = weight.get(g, 0.0) + float(p.detach().double().pow(2).sum())
    total = math.sqrt(sum(delta.values()) / sum(weight.values()))
    return {g: math.sqrt(delta[g] / weight[g]) for g in delta}, total


def _run(model, opt, steps: int, lr_at=None, batch_at=None, clip: float | None = None, **watch_args):
    """A plain loop; ``lr_at(step)`` sets every group's LR, ``batch_at(step)`` the batch (default: one
    repeated batch). Returns the detached watch and the losses."""
    losses = []
    settings = watch_args.pop("settings", None)  # (nbguard.watch takes no settings: the watch class does)
    attached = NanWatch(model, optimizer=opt, settings=settings).attach() if settings is not None \
        else nbguard.watch(model, optimizer=opt, verify=False, **watch_args)
    with attached as watch:
        for step in range(steps):
            if lr_at is not None:
                for group in opt.param_groups:
                    group["lr"] = lr_at(step)
            loss = model(**(batch_at(step) if batch_at is not None else tiny_batch())).loss
            loss.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
    return watch, losses


@pytest.mark.parametrize("make_opt, clip", [
    (lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1), None),
    (lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1), 0.5),  # the clip's shared norms path
    (lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.9, weight_decay=0.01), None),
], ids=["adamw", "adamw-clipped", "sgd-momentum"])
@pytest.mark.parametrize("gather_below", [update_norms.GATHER_BELOW, 0], ids=["gathered", "per-tensor"])
def test_update_norms_equal_the_weights_moved_by_each_step(make_opt, clip, gather_below, monkeypatch):
    """Both ways of comparing the weights with their copy (this model's small tensors are gathered; a full
    fine-tune's large ones are subtracted tensor by tensor: ``GATHER_BELOW=0`` takes that path here)."""
    monkeypatch.setattr(update_norms, "GATHER_BELOW", gather_below)
    model = tiny_llama()
    opt = make_opt(model.parameters())
    expected: list[tuple[dict[str, float], float]] = []
    with nbguard.watch(model, optimizer=opt, verify=False) as watch:
        for step in range(5):
            loss = model(**tiny_batch(seed=step)).loss
            loss.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            before = _weights(model)
            opt.step()
            expected.append(_ratios(before, model))
            opt.zero_grad(set_to_none=True)
    history = watch.history
    (reader,) = [d for d in watch.detectors if isinstance(d, UpdateNorms)]
    assert reader._gather is (gather_below > 0)
    assert history.steps == [0, 1, 2, 3, 4] and history.update_norm_unavailable is None
    for i, (groups, total) in enumerate(expected):  # the last step's too: detach reads it
        assert history.total_update_norm[i] == pytest.approx(total, rel=1e-4), i
        assert set(groups) == set(history.groups)
        for group, ratio in groups.items():
            assert history.update_norm(group)[i] == pytest.approx(ratio, rel=1e-4, abs=1e-9), (i, group)
    # the update moved: not a ratio of 0 (and not 1: the weights are not all new)
    assert all(0 < v < 0.5 for v in history.total_update_norm)


@pytest.mark.parametrize("gather_below", [update_norms.GATHER_BELOW, 0], ids=["gathered", "per-tensor"])
def test_weights_whose_storage_is_replaced_mid_run_are_read_from_their_new_storage(gather_below, monkeypatch):
    """The watch gathers the weights through views made once: ``p.data = ...`` (a load, a move) must not
    leave it reading the old storage (a ratio of 0)."""
    monkeypatch.setattr(update_norms, "GATHER_BELOW", gather_below)
    model = tiny_llama()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    expected = []
    with nbguard.watch(model, optimizer=opt, verify=False) as watch:
        for step in range(4):
            if step == 2:
                for p in model.parameters():
                    p.data = p.data.clone()
            model(**tiny_batch(seed=step)).loss.backward()
            before = _weights(model)
            opt.step()
            expected.append(_ratios(before, model)[1])
            opt.zero_grad(set_to_none=True)
    assert watch.history.total_update_norm == pytest.approx(expected, rel=1e-4)


def test_an_lr_jump_is_an_update_spike_before_the_loss_spikes_and_the_divergence():
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # the LR x1000 for steps 20-22 (the "LR at 1.0 for three steps")
    watch, losses = _run(model, opt, 40, lr_at=lambda s: 1.0 if 20 <= s < 23 else 1e-3)
    kinds = [e.kind for e in watch.events]
    assert "update-spike" in kinds and "divergence" in kinds, kinds
    spike = next(e for e in watch.events if e.kind == "update-spike")
    diverged = next(e for e in watch.events if e.kind == "divergence")
    # the loss of step s is computed before step s's update: the damaged weights show from step 21
    loss_spike = next(s for s in range(5, len(losses)) if losses[s] > 2 * statistics.median(losses[s - 5:s]))
    assert spike.step == 20 and loss_spike == 21
    assert spike.step < loss_spike and spike.step <= diverged.step
    assert kinds.index("update-spike") < kinds.index("divergence")  # said first, too
    assert kinds.count("update-spike") == 1  # one event for the three steps of the jump
    evidence = spike.evidence
    assert evidence["decades_above_level"] > 2 and evidence["ratio"] > 100
    assert evidence["update_ratio"] == pytest.approx(watch.history.total_update_norm[20])
    assert evidence["largest_groups"] and evidence["largest_groups"][0]["group"] in watch.history.groups
    assert evidence["fixes"] == ["lower-learning-rate", "add-warmup", "enable-grad-clipping"]
    assert "a loss spike often follows" in spike.message


def test_a_memorising_run_stays_quiet_while_its_update_norms_fall_over_decades():
    model = tiny_llama()
    watch, losses = _run(model, torch.optim.AdamW(model.parameters(), lr=1e-2), 80)
    totals = watch.history.total_update_norm
    assert losses[-1] < 1e-2 < 1 < losses[0]  # it memorised the batch
    assert all(v is not None for v in totals) and max(totals) / min(totals) > 100  # the ratio drifted 2+ decades
    assert watch.events == []


def test_a_healthy_run_with_warmup_and_fresh_batches_stays_quiet():
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    watch, _ = _run(model, opt, 40, lr_at=lambda s: 3e-3 * min(1.0, (s + 1) / 15),
                    batch_at=lambda s: tiny_batch(batch_size=4, seed=s))
    totals = watch.history.total_update_norm
    assert totals[14] > 3 * totals[0]  # the warmup (LR x15) raised the update 4x: still no spike
    assert watch.events == []


def test_over_the_budget_the_history_says_why_once_and_nothing_else_changes():
    model = tiny_llama()
    watch, _ = _run(model, torch.optim.SGD(model.parameters(), lr=0.1), 3,
                    settings=WatchSettings(update_norm_budget_mb=0.01))
    assert watch.history.total_update_norm == [None, None, None] and watch.events == []
    assert "over the update-norm budget of 0 MiB" in watch.history.update_norm_unavailable
    section = watch.to_document()["history"]
    assert "update_norm" not in section and "update_norm_budget_mb" in section["update_norm_unavailable"]
    assert update_norms_png(section) is None
    off, _ = _run(tiny_llama(), torch.optim.SGD(model.parameters(), lr=0.1), 2,
                  settings=WatchSettings(update_norms=False))
    assert not [d for d in off.detectors if isinstance(d, UpdateNorms)]
    assert off.history.total_update_norm == [None, None]


def test_the_document_report_and_heatmap_carry_them(tmp_path):
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    watch, _ = _run(model, opt, 30, lr_at=lambda s: 1.0 if s == 20 else 1e-3)
    doc = watch.to_document()
    jsonschema.Draft202012Validator(schema()).validate(doc)
    section = doc["history"]
    assert len(section["update_norm"]) == len(section["groups"]) and len(section["total_update_norm"]) == 30
    i = section["groups"].index(watch.history.groups[0])
    assert section["update_norm"][i] == pytest.approx(watch.history.update_norm(watch.history.groups[0]))
    assert any(e["kind"] == "update-spike" and e["step"] == 20 for e in doc["events"])
    png = update_norms_png(section)
    assert png is not None and png[:8] == b"\x89PNG\r\n\x1a\n"
    report = nbguard.report(watch=watch)
    peak = max(watch.history.total_update_norm)
    text, markdown = str(report), report.to_markdown()
    for shown in (text, markdown):
        assert "update ‖Δw‖/‖w‖: median" in shown and "at step 20" in shown and "update-spike" in shown
    saved = report.save(tmp_path / "r.json")
    jsonschema.Draft202012Validator(schema()).validate(__import__("json").loads(saved.read_text()))
    assert peak == watch.history.total_update_norm[20]


def test_the_tracker_scalars_reach_tensorboard(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    from nbguard.trackers.names import short_names

    writer = SummaryWriter(str(tmp_path))
    model = tiny_llama()
    watch, _ = _run(model, torch.optim.AdamW(model.parameters(), lr=1e-3), 4, log_to=writer, log_every=1)
    writer.close()
    acc = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    acc.Reload()
    names = short_names(watch.history.groups)
    tags = acc.Tags()["scalars"]
    assert "nbguard/total_update_norm" in tags
    # step s logs the update its read brought: step s-1's (a plain loop's read comes before its step)
    logged = {p.step: p.value for p in acc.Scalars("nbguard/total_update_norm")}
    assert sorted(logged) == [1, 2, 3]
    for step, value in logged.items():
        assert value == pytest.approx(watch.history.total_update_norm[step - 1], rel=1e-6)
    group = watch.history.groups[0]
    by_step = {p.step: p.value for p in acc.Scalars(f"nbguard/update_norm/{names[group]}")}
    assert by_step[2] == pytest.approx(watch.history.update_norm(group)[1], rel=1e-6)


def test_a_trainer_run_records_every_steps_update_norms(tmp_path):
    from transformers import Trainer, TrainingArguments

    from nbguard.testing import TinyDataset

    model = tiny_llama()
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=5, per_device_train_batch_size=4, use_cpu=True,
                             report_to=[], save_strategy="no", disable_tqdm=True, learning_rate=1e-3,
                             max_grad_norm=1.0)
    trainer = Trainer(model=model, args=args, train_dataset=TinyDataset(32))
    watch = nbguard.watch(trainer, verify=False)
    before = _weights(model)
    trainer.train()
    watch.detach()
    totals = watch.history.total_update_norm
    # every step read, the last one too (the Trainer's train end); together they moved the weights
    assert len(totals) == 5 and all(v is not None and 0 < v < 0.5 for v in totals)
    _, moved = _ratios(before, model)
    assert moved > max(totals) * 0.5 and watch.events == []


def test_under_a_grad_scaler_a_steps_update_norms_arrive_with_the_step_itself():
    """The GradScaler's read comes after the optimizer step: the step's own update norms ride in it."""
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4)
    seen = []
    expected = []
    with nbguard.watch(model, optimizer=opt, scaler=scaler, verify=False) as watch:
        watch.add_listener(lambda w, kind, payload: seen.append((payload["step"], payload.get("update_norm_step")))
                           if kind == "step" else None)
        for step in range(4):
            scaler.scale(model(**tiny_batch(seed=step)).loss).backward()
            before = _weights(model)
            scaler.step(opt)
            scaler.update()
            expected.append(_ratios(before, model)[1])
            opt.zero_grad(set_to_none=True)
    assert seen == [(0, 0), (1, 1), (2, 2), (3, 3)]
    assert watch.history.total_update_norm == pytest.approx(expected, rel=1e-4)
