"""policy="rewind" through the HF Trainer, and the rows that broke a step named by dataset index
(tiny models, CPU, no downloads)."""
import json
import math
import tempfile

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

import nbguard
from nbguard.testing import TinyDataset, plant_fp16_overflow_token, tiny_llama
from nbguard.watcher import RewindSettings
from nbguard.watcher.localise.rows import bad_row_indices, save_rows

torch.set_num_threads(1)

HOT = 100  # the token planted to overflow fp16 in layer 0's q_proj
POISONED = 37  # the dataset index of the one row that holds it


def _args(**overrides):
    base = dict(output_dir=tempfile.mkdtemp(), max_steps=100, per_device_train_batch_size=4, use_cpu=True,
                report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True, learning_rate=1e-3,
                lr_scheduler_type="constant", seed=0)
    base.update(overrides)
    return TrainingArguments(**base)


class _LRSpike(TrainerCallback):
    """Puts the LR at 1.0 for optimizer steps 20-22 (a bad schedule); the Trainer's scheduler puts it back."""

    def on_step_begin(self, args, state, control, **kwargs):
        if 20 <= state.global_step < 23:
            for group in kwargs["optimizer"].param_groups:
                group["lr"] = 1.0


def _train(policy=None, spike=True):
    model = tiny_llama()
    trainer = Trainer(model=model, args=_args(), train_dataset=TinyDataset(64),
                      callbacks=[_LRSpike()] if spike else [])
    watch = nbguard.watch(trainer, policy=policy, verify=False, log_to=None,
                          rewind=RewindSettings(every=5)) if policy else None
    trainer.train()
    if watch is not None:
        watch.detach()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return sum(losses[-10:]) / 10, watch, trainer


def test_trainer_rewind_recovers_a_run_an_lr_spike_ruined():
    healthy, _, _ = _train(spike=False)
    ruined, _, _ = _train()
    rewound, watch, trainer = _train(policy="rewind")
    assert ruined > 1.25 * healthy
    assert math.isfinite(rewound) and abs(rewound - healthy) <= 0.25 * healthy
    rewinds = [e for e in watch.events if e.kind == "rewind"]
    assert rewinds and rewinds[0].evidence["trigger"] == "divergence"
    assert rewinds[0].evidence["restored_after_step"] <= 19
    assert trainer.state.global_step == 100  # the data moved on: the batches in between were skipped
    scheduler = trainer.lr_scheduler.scheduler if hasattr(trainer.lr_scheduler, "scheduler") else trainer.lr_scheduler
    assert scheduler.base_lrs[0] < 1e-3  # the LR cut reached the Trainer's own scheduler


class AutocastTrainer(Trainer):
    """A Trainer whose forward runs under fp16 autocast on the CPU (accelerate does not autocast fp16 there)."""

    def compute_loss(self, model, inputs, *args, **kwargs):
        with torch.autocast("cpu", dtype=torch.float16):
            return super().compute_loss(model, inputs, *args, **kwargs)


def _poisoned_data(rows=64):
    data = TinyDataset(rows)
    for row in data.rows:
        for key in ("input_ids", "labels"):
            row[key] = torch.where(row[key] == HOT, torch.full_like(row[key], HOT + 1), row[key])
    data.rows[POISONED]["input_ids"][5] = HOT
    data.rows[POISONED]["labels"][5] = HOT
    return data


def test_trainer_event_names_the_poisoned_rows_dataset_index_and_drop_rows_removes_exactly_it(tmp_path):
    model = tiny_llama()
    plant_fp16_overflow_token(model, HOT)
    data = _poisoned_data()
    trainer = AutocastTrainer(model=model, args=_args(max_steps=16, learning_rate=1e-4), train_dataset=data)
    watch = nbguard.watch(trainer, policy="rewind", verify=False, log_to=None, rewind=RewindSettings(every=2))
    trainer.train()
    watch.detach()
    [bad] = [e for e in watch.events if e.kind == "nonfinite-loss"]  # one epoch: the row is drawn once
    # the weights stayed finite (the row's batch was bad, not the state): skipped, no progress thrown away
    assert bad.evidence["rewind"]["restored"] is False and "nothing to undo" in bad.evidence["rewind"]["reason"]
    assert not [e for e in watch.events if e.kind == "rewind"] and watch.history.skipped_steps == [bad.step]
    assert bad.evidence["rows"]["nonfinite"] is True
    assert bad_row_indices(bad) == [POISONED]
    assert f"dataset index {POISONED}" in bad.message
    [row] = bad.evidence["rows"]["rows"]
    assert not math.isfinite(row["loss"]) and row["tokens"] == 15
    assert bad.evidence["rows"]["rows_checked"] == 4  # every row of the step was replayed, the others finite
    # the indices as a file, and the fix's cell reading them
    path = save_rows(bad, tmp_path / "bad-rows.json")
    assert json.loads(path.read_text())["dataset_indices"] == [POISONED]
    for cell in (nbguard.fixes.code("drop-rows", trainer="trainer", indices=bad_row_indices(bad)),
                 nbguard.fixes.code("drop-rows", trainer="trainer", path=str(path))):
        trainer.train_dataset = data
        exec(cell, {"trainer": trainer})
        kept = [trainer.train_dataset[i] for i in range(len(trainer.train_dataset))]
        assert len(kept) == len(data) - 1
        assert not any(r is data.rows[POISONED] for r in kept)
        assert all(any(r is row for r in kept) for i, row in enumerate(data.rows) if i != POISONED)
    # the fix applied in the kernel does the same, once
    trainer.train_dataset = data
    result = nbguard.fixes.apply("drop-rows", trainer=trainer, indices=[POISONED])
    assert result.changed and len(trainer.train_dataset) == 63
    assert not nbguard.fixes.apply("drop-rows", trainer=trainer, indices=[POISONED]).changed


def _fp16_loop_watched(model, loader):
    """A plain fp16-autocast loop over ``loader`` under a skip watch that follows it; (the watch, the
    input_ids of each step's batch, in order)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    watch = nbguard.watch(model, optimizer=opt, policy="skip", verify=False)
    assert watch.track_rows(loader)
    order = []
    for batch in loader:
        order.append(batch["input_ids"])
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    watch.detach()
    return watch, order


def test_a_plain_loader_names_rows_by_dataset_index():
    model = tiny_llama()
    plant_fp16_overflow_token(model, HOT)
    data = _poisoned_data(40)
    torch.manual_seed(3)
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
    watch, order = _fp16_loop_watched(model, loader)
    [bad] = [e for e in watch.events if e.kind == "nonfinite-loss"]
    assert bad_row_indices(bad) == [POISONED]
    [row] = bad.evidence["rows"]["rows"]
    assert bool((order[bad.step][row["row"]] == HOT).any())  # the position it names holds the hot token
    assert loader.batch_sampler.sampler is loader.sampler  # detach put the loader's own sampler back


def test_without_a_followed_loader_rows_are_named_by_position():
    model = tiny_llama()
    plant_fp16_overflow_token(model, HOT)
    batch = {k: torch.stack([r[k] for r in _poisoned_data(40).rows[34:38]]) for k in ("input_ids", "labels")}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    with nbguard.watch(model, optimizer=opt, policy="skip", verify=False) as watch:
        with torch.autocast("cpu", dtype=torch.float16):
            model(**batch).loss.backward()
        opt.step()
    [bad] = watch.events
    assert bad_row_indices(bad) == []
    assert [(r["micro_batch"], r["row"]) for r in bad.evidence["rows"]["rows"]] == [(0, POISONED - 34)]
    assert "micro-batch 0 row 3" in bad.message


def test_bad_batches_in_a_row_rewind_even_with_finite_weights():
    """One bad batch is skipped; a second bad step in a row means skipping is not enough: rewind."""
    model = tiny_llama()
    plant_fp16_overflow_token(model, HOT)
    rows = _poisoned_data(40).rows
    clean = [r for i, r in enumerate(rows) if i != POISONED]
    batches = [{k: torch.stack([r[k] for r in clean[4 * b:4 * b + 4]]) for k in ("input_ids", "labels")}
               for b in range(9)]
    for b in (6, 7):
        batches[b] = {k: v.clone() for k, v in batches[b].items()}
        batches[b]["input_ids"][1, 5] = HOT
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    with nbguard.watch(model, optimizer=opt, policy="rewind", verify=False, rewind=RewindSettings(every=2)) as watch:
        for batch in batches:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(**batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
    [bad] = [e for e in watch.events if e.kind == "nonfinite-loss"]
    [rewind] = [e for e in watch.events if e.kind == "rewind"]
    assert bad.step == 6 and bad.evidence["consecutive_bad_steps"] == 2
    assert rewind.step == 7 and rewind.evidence["restored_after_step"] == 4


def test_a_collator_that_drops_rows_leaves_rows_named_by_position_only():
    """Micro-batches that stop matching the indices drawn (packing, dropped rows) must never be named by
    an index that may be another row's."""
    model = tiny_llama()
    plant_fp16_overflow_token(model, HOT)
    data = _poisoned_data(40)

    def drop_last_row(rows):  # 4 drawn, 3 trained on: the queue of drawn indices runs ahead
        batch = torch.utils.data.default_collate(rows)
        return {k: v[:-1] for k, v in batch.items()}

    order = list(range(40))
    order.remove(POISONED)
    order.append(POISONED)  # the poisoned row comes last, long after the indices fell out of step
    loader = torch.utils.data.DataLoader(data, batch_size=4, sampler=order, collate_fn=drop_last_row)
    order[-4:] = [POISONED, *order[-4:-1]]  # ... and first in its batch, so the collator keeps it
    watch, _ = _fp16_loop_watched(model, loader)
    [bad] = [e for e in watch.events if e.kind == "nonfinite-loss"]
    assert bad_row_indices(bad) == [] and "dataset_indices_unknown" in bad.evidence["rows"]
    assert [(r["micro_batch"], r["row"], r["dataset_index"]) for r in bad.evidence["rows"]["rows"]] == [(0, 0, None)]
