"""``nbguard.callback()``: the full watch on a Trainer that a framework builds and never hands back, as
LLaMA-Factory's ``run_exp(callbacks=[...])`` does. ``run_exp`` below is such a function: it builds a real
transformers Trainer on a tiny Llama, trains it, and returns only the trained model and the losses."""
from __future__ import annotations

import math
import tempfile
from functools import partial

import pytest
import torch
from framework_helpers import LRBlowUp, SeenAtEnd, check_caught_and_rewound, check_trainer_counts_kept, final_loss
from transformers import Trainer, TrainerCallback, TrainingArguments

import nbguard
from nbguard.testing import TinyDataset, tiny_llama
from nbguard.watcher import RewindSettings
from nbguard.watcher.integrations.trainer_callback import calling_trainer

torch.set_num_threads(1)

STEPS = 12


class _PlantNaN(TrainerCallback):
    """The framework's own callback: makes layer 1's MLP output NaN during optimizer step ``at``."""

    def __init__(self, at):
        self.at, self.hook = at, None

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if state.global_step == self.at:
            self.hook = model.model.layers[1].mlp.register_forward_hook(lambda m, a, out: out * float("nan"))

    def on_step_end(self, args, state, control, **kwargs):
        if self.hook is not None:
            self.hook.remove()
            self.hook = None


def _trainer(callbacks, **overrides):
    settings = dict(output_dir=tempfile.mkdtemp(), max_steps=STEPS, per_device_train_batch_size=4, use_cpu=True,
                    report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True, learning_rate=1e-3,
                    lr_scheduler_type="constant", seed=0)
    return Trainer(model=tiny_llama(), args=TrainingArguments(**{**settings, **overrides}),
                   train_dataset=TinyDataset(64), callbacks=callbacks)


def run_exp(callbacks=None, *, plant_at=None, add_later=(), **overrides):
    """A framework's entry point: the Trainer is built and trained in here and never returned."""
    own = [_PlantNaN(plant_at)] if plant_at is not None else []
    trainer = _trainer([*own, *(callbacks or [])], **overrides)
    for callback in add_later:
        trainer.add_callback(callback)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return trainer.model, losses, trainer.state.global_step


def _same_weights(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def test_a_healthy_run_is_bit_identical_to_an_unwatched_one_and_quiet():
    twin, twin_losses, _ = run_exp()
    cb = nbguard.callback(log_to=None, verify=False)
    model, losses, steps = run_exp([cb])
    assert _same_weights(model, twin) and losses == twin_losses and steps == STEPS
    assert cb.watch is not None and cb.watch.trainer is not None and cb.watch.events == []
    assert len(cb.watch.history.loss) == STEPS
    assert cb.watch.history.loss == pytest.approx(losses, rel=1e-4)  # the Trainer's logged loss, step by step


def test_it_attaches_what_nbguard_watch_attaches_to_the_trainer_the_framework_built():
    seen = {}

    class Spy(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            seen["trainer"] = calling_trainer(self, state)

    cb = nbguard.callback(log_to=None, verify=False)
    run_exp([cb, Spy()])
    trainer = seen["trainer"]
    assert cb.watch.trainer is trainer and cb.watch.target is trainer
    held = [type(c).__name__ for c in trainer.callback_handler.callbacks]
    assert "WatchCallback" in held  # the watch's own Trainer callback, as nbguard.watch(trainer) adds it
    assert cb.watch.optimizer is trainer.optimizer.optimizer or cb.watch.optimizer is trainer.optimizer


def test_a_nan_planted_at_a_step_is_found_at_that_step_in_that_module_and_skip_keeps_the_weights_finite():
    cb = nbguard.callback(policy="skip", log_to=None, verify=False)
    model, _, steps = run_exp([cb], plant_at=5)
    bad = [e for e in cb.watch.events if e.kind.startswith("nonfinite")]
    assert [(e.kind, e.step) for e in bad] == [("nonfinite-loss", 5)]
    assert bad[0].origins[0].module == "model.layers.1.mlp"
    assert cb.watch.history.skipped_steps == [5]
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert steps == STEPS


def test_a_callback_added_after_the_trainer_was_built_attaches_when_training_starts():
    cb = nbguard.callback(policy="skip", log_to=None, verify=False)
    run_exp(add_later=[cb], plant_at=3)
    assert [(e.kind, e.step) for e in cb.watch.events if e.kind.startswith("nonfinite")] == [("nonfinite-loss", 3)]


def test_a_watch_you_detach_stays_detached_and_a_second_trainer_gets_its_own():
    cb = nbguard.callback(log_to=None, verify=False)
    first = _trainer([cb], max_steps=2)
    watch = cb.watch
    assert watch.trainer is first and watch.attached
    watch.detach()
    first.train()
    assert cb.watch is watch and not watch.attached and watch.history.loss == []
    second = _trainer([cb], max_steps=2)
    assert cb.watch is not watch and cb.watch.trainer is second and cb.watch.attached
    second.train()
    assert len(cb.watch.history.loss) == 2


def test_rewind_through_the_callback_rescues_an_lr_blow_up():
    _, healthy, _ = run_exp(max_steps=100)
    _, ruined, _ = run_exp([LRBlowUp(at=20)], max_steps=100)
    cb = nbguard.callback(policy="rewind", rewind=RewindSettings(every=5), log_to=None, verify=False)
    _, rewound, _ = run_exp([LRBlowUp(at=20), cb], max_steps=100)
    final = partial(final_loss, last=10)
    assert final(ruined) > 1.25 * final(healthy)
    assert math.isfinite(final(rewound)) and abs(final(rewound) - final(healthy)) <= 0.25 * final(healthy)
    assert [e for e in cb.watch.events if e.kind == "rewind"][0].evidence["trigger"] == "divergence"


BLOW_UP_AT = 20
# 40 optimizer steps of 2 accumulated micro-batches: accumulation is what the rewind must leave as it was
BLOW_UP_RUN = {"max_steps": 40, "gradient_accumulation_steps": 2}


@pytest.fixture(scope="module")
def blow_up():
    """One LR blow-up (x1000 for optimizer steps 20-22), three runs: (healthy, spiked, rewound, the watch);
    the first two unwatched."""
    healthy, spiked, rewound = SeenAtEnd(), SeenAtEnd(), SeenAtEnd()
    run_exp([healthy], **BLOW_UP_RUN)
    run_exp([LRBlowUp(BLOW_UP_AT), spiked], **BLOW_UP_RUN)
    cb = nbguard.callback(policy="rewind", rewind=RewindSettings(every=5), log_to=None, verify=False)
    run_exp([LRBlowUp(BLOW_UP_AT), cb, rewound], **BLOW_UP_RUN)
    return healthy, spiked, rewound, cb.watch


def test_an_lr_blow_up_is_a_divergence_where_it_first_shows_and_rewind_keeps_the_trainers_counts(blow_up):
    healthy, spiked, rewound, watch = blow_up
    rewinds = check_caught_and_rewound(watch, healthy.losses, spiked.losses, BLOW_UP_AT, rewound.model)
    check_trainer_counts_kept(healthy, rewound, rewinds, BLOW_UP_RUN)


def test_rewind_brings_an_lr_blow_up_back_within_a_quarter_of_the_healthy_final_loss(blow_up):
    """Rewound at step 21 to step 15's state, the LR cut; the bad schedule's step 22 (x1000) then runs at most at
    the cut LR (held for ``every`` steps): without the hold it ran at 0.5, did damage under the divergence
    thresholds and the run ended at 6.24 against the healthy 4.18 (+49%)."""
    healthy, spiked, rewound, watch = blow_up
    assert final_loss(spiked.losses) > 1.25 * final_loss(healthy.losses)
    assert abs(final_loss(rewound.losses) - final_loss(healthy.losses)) <= 0.25 * final_loss(healthy.losses)
    rewind = next(e for e in watch.events if e.kind == "rewind")
    held = rewind.evidence["lr_held"]  # the constant LR the restored state trained at, cut, for 5 steps
    assert held["through_step"] == rewind.step + 5
    assert held["at_most"] == pytest.approx([lr * 0.5 for lr in healthy.scheduler.base_lrs])


def test_outside_a_trainer_it_says_so_and_watches_nothing():
    from transformers import TrainerControl, TrainerState

    cb = nbguard.callback(log_to=None)
    with pytest.warns(RuntimeWarning, match="found no transformers Trainer"):
        cb.on_init_end(None, TrainerState(), TrainerControl())
    assert cb.watch is None


def test_the_callback_checks_its_options_when_made():
    with pytest.raises(ValueError, match="policy='bogus'"):
        nbguard.callback(policy="bogus")
    with pytest.raises(TypeError, match="sets target"):
        nbguard.callback(target=None)
