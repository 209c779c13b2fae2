"""Issue 12 section 3: every step a GradScaler skips is an event with its step number, the first of
each streak localised by replay, the rest of the streak pointing at it (folded for display).

Three real paths: a plain loop with ``torch.amp.GradScaler("cpu")``, a real HF Trainer whose
accelerator is handed a CPU GradScaler (as on a GPU with fp16=True), and a plain accelerate loop
(AcceleratedOptimizer.step calls scaler.step and scaler.update itself).
"""
import tempfile

import pytest
import torch
from transformers import Trainer, TrainerCallback, TrainingArguments
from watch_helpers import PoisonedSiLU, autocast_ctx, batches, train, with_token

import nbguard
from nbguard.findings import Event
from nbguard.testing import TinyDataset, tiny_llama
from nbguard.watcher.core.watch import fold_skip_streaks

torch.set_num_threads(1)
BAD_TOKEN = 7


def _nan_row_model():
    """Embedding row 7 is NaN: only a batch that contains token 7 makes non-finite values."""
    model = tiny_llama()
    with torch.no_grad():
        model.model.embed_tokens.weight[BAD_TOKEN] = float("nan")
    return model


def _plain_run(bad_steps, steps=8):
    model = _nan_row_model()
    data = batches(steps, avoid=BAD_TOKEN)
    for i in bad_steps:
        data[i] = with_token(data[i], BAD_TOKEN)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    with nbguard.watch(model, optimizer=opt, scaler=scaler) as watch:
        train(model, opt, data, scaler=scaler, autocast=torch.float16)
    return watch


def test_each_skipped_step_is_an_event_and_the_first_of_each_streak_is_localised():
    watch = _plain_run([2, 5, 6])
    assert watch.history.skipped_steps == [2, 5, 6]
    skips = [e for e in watch.events if e.kind == "scaler-skip"]
    assert [e.step for e in skips] == [2, 5, 6] and len(skips) == len(watch.events)  # no streak alarm
    assert [e.evidence["streak_start"] for e in skips] == [2, 5, 5]
    for first in (skips[0], skips[1]):  # each streak's first step was replayed
        assert first.cause == "nonfinite-parameter"
        assert first.origin("forward").module == "model.embed_tokens"
        assert first.evidence["loss_scale"] in (1024.0, 512.0)
    assert skips[2].origins == [] and skips[2].evidence["localised_at_step"] == 5
    folded = [(e.step, last, count) for e, last, count in fold_skip_streaks(watch.events)]
    assert folded == [(2, 2, 1), (5, 6, 2)]
    assert "steps 5-6 [scaler-skip] x2" in watch.summary()
    # the new kind is part of the document vocabulary: it survives a round trip
    assert [Event.from_dict(e.to_dict()).evidence["streak_start"] for e in skips] == [2, 5, 5]


def test_a_clean_scaler_run_has_no_skip_events():
    watch = _plain_run([])
    assert watch.events == [] and watch.history.skipped_steps == [] and watch.step == 8


def test_a_streak_alarm_reuses_the_localisation_of_the_streaks_first_step():
    watch = _plain_run(list(range(1, 10)), steps=10)
    alarm = [e for e in watch.events if e.kind == "skipped-steps"]
    assert len(alarm) == 1 and alarm[0].step == 8 and alarm[0].evidence["streak_start"] == 1
    assert alarm[0].evidence["localised_at_step"] == 1
    assert alarm[0].origin("forward").module == "model.embed_tokens"
    assert watch._localiser.skip_replays == 1 and watch._localiser.replays == 0  # one replay for the whole streak


class _ArmAt(TrainerCallback):
    def __init__(self, module, steps):
        self.module, self.steps = module, steps

    def on_step_begin(self, args, state, control, **kwargs):
        self.module.armed = state.global_step in self.steps


def test_trainer_with_an_injected_cpu_grad_scaler_reports_every_skipped_step():
    model = tiny_llama()
    act = model.model.layers[1].mlp.act_fn = PoisonedSiLU(armed=False)
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), max_steps=6, per_device_train_batch_size=2,
                             use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=TinyDataset(32), callbacks=[_ArmAt(act, {1, 3, 4})])
    trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    watch = nbguard.watch(trainer)
    trainer.train()
    watch.detach()
    assert watch.history.skipped_steps == [1, 3, 4]
    skips = [e for e in watch.events if e.kind == "scaler-skip"]
    assert [e.step for e in skips] == [1, 3, 4] and [e.evidence["streak_start"] for e in skips] == [1, 3, 3]
    assert skips[0].origin("backward").module == "model.layers.1.mlp.act_fn"
    assert skips[1].origin("backward").module == "model.layers.1.mlp.act_fn"
    assert not [e for e in watch.events if e.kind != "scaler-skip"], watch.summary()


@pytest.mark.parametrize("armed_steps", [{2}, set()])
def test_accelerate_optimizer_and_its_scaler(armed_steps):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()
    accelerator = Accelerator(cpu=True)
    accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)  # what fp16 on a GPU creates
    model = tiny_llama()
    act = model.model.layers[0].mlp.act_fn = PoisonedSiLU(armed=False)
    model, opt = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    watch = nbguard.watch(model, optimizer=opt, scaler=accelerator.scaler)
    for step, batch in enumerate(batches(4)):
        act.armed = step in armed_steps
        with autocast_ctx(torch.float16):
            loss = model(**batch).loss
        accelerator.backward(loss)
        opt.step()  # AcceleratedOptimizer: scaler.step(optimizer) then scaler.update()
        opt.zero_grad()
    watch.detach()
    AcceleratorState._reset_state()
    assert watch.step == 4 and watch.history.skipped_steps == sorted(armed_steps)
    assert [e.step for e in watch.events] == sorted(armed_steps)
    if armed_steps:
        assert watch.events[0].kind == "scaler-skip"
        assert watch.events[0].origin("backward").module == "model.layers.0.mlp.act_fn"


def test_skip_streaks_are_in_the_document_and_survive_a_report():
    import jsonschema

    from nbguard.document.merge import gather
    from nbguard.document.schema import schema

    watch = _plain_run([2, 5, 6])
    doc = watch.to_document()
    assert doc["skip_streaks"] == [
        {"first_step": 2, "last_step": 2, "count": 1, "cause": "nonfinite-parameter", "module": "model.embed_tokens",
         "loss_scale": 1024.0},
        {"first_step": 5, "last_step": 6, "count": 2, "cause": "nonfinite-parameter", "module": "model.embed_tokens",
         "loss_scale": 512.0}]
    jsonschema.Draft202012Validator(schema()).validate(doc)
    report = nbguard.report(watch=watch).to_document()  # the session story: the watch inside a report
    jsonschema.Draft202012Validator(schema()).validate(report)
    assert gather(report, "watches")[0]["skip_streaks"] == doc["skip_streaks"]
    assert "skip_streaks" not in _plain_run([]).to_document()


def test_the_views_fold_each_streak_into_one_card_with_its_steps():
    from nbguard.document.view import view
    from nbguard.render import render_text

    watch = _plain_run([2, 5, 6])
    doc = watch.to_document()
    all_cards = view(doc).section("watch").cards
    cards = [c for c in all_cards if c.tag == "scaler-skip"]  # the others: the fixes verified on a step
    assert len(cards) == 2  # three events, two streaks
    assert cards[0].title.startswith("step 2: ")
    assert cards[1].title.startswith("steps 5–6 (2 steps skipped by the GradScaler)")
    assert cards[1].table.rows[0][1] == "model.embed_tokens"  # the streak's first step carries the origin
    assert "steps 5–6 (2 steps skipped by the GradScaler)" in render_text(doc)
