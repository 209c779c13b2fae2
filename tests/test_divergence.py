"""Issue 20 item 1: divergence and dead runs, judged against the run's own noise, on real runs.

The reproduction: TRL's ``sft.py --learning_rate 1000`` logs loss 1.6e7 / grad norm 7.5e13 at step 2,
then grad norm 0 and a constant loss for ever. On a tiny Qwen2 the same mechanism gives 2.3e7 / 2.5e8
at step 2 (watch step 1), then the logits go flat: loss ln(128) = 4.852, gradient exactly 0.
"""
from __future__ import annotations

import math

import pytest
import torch
from peft import LoraConfig, get_peft_model
from watch_helpers import train

import nbguard
from nbguard.testing import TINY_VOCAB, tiny_batch, tiny_llama, tiny_qwen2, word_tokenizer

torch.set_num_threads(1)


def sft_trainer(tmp_path, learning_rate: float, steps: int):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    gen = torch.Generator().manual_seed(0)
    rows = [{"text": " ".join(f"w{i}" for i in torch.randint(3, TINY_VOCAB, (12,), generator=gen).tolist())}
            for _ in range(64)]
    args = SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=steps, logging_steps=1,
                     report_to="none", use_cpu=True, learning_rate=learning_rate, save_strategy="no", max_length=32,
                     disable_tqdm=True)
    return SFTTrainer(model=tiny_qwen2(), args=args, train_dataset=Dataset.from_list(rows),
                      processing_class=word_tokenizer())


def kinds(watch) -> list[str]:
    return [e.kind for e in watch.events]


def test_sft_learning_rate_1000_explodes_then_dies(tmp_path):
    trainer = sft_trainer(tmp_path, learning_rate=1000.0, steps=10)
    watch = nbguard.watch(trainer, verify=False)
    trainer.train()
    assert kinds(watch) == ["divergence", "dead-run"]
    diverged, dead = watch.events
    assert diverged.step == 1 and diverged.evidence["decades_above_level"] > 6
    assert diverged.evidence["loss"] > 1e6 and diverged.evidence["recent_loss_median"] < 10
    assert diverged.evidence["exploded_groups"][0]["group"] == "model.embed_tokens"
    # dead from step 2 on: flat logits, gradient exactly 0, named within 4 steps. The loss is the one the
    # Trainer logs: ln(vocab) per predicted token, over a divisor transformers 5.9 counts before the
    # causal shift (12/13 of it there), so the claim is checked against the run's own log
    assert dead.step == 5 and dead.evidence["dead_since_step"] == 2 and dead.evidence["after_explosion_at_step"] == 1
    logged = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert dead.evidence["zero_gradient"] and dead.evidence["constant_loss"] == pytest.approx(logged[2]) == logged[5]
    assert math.log(TINY_VOCAB) * 12 / 13 - 1e-4 <= logged[2] <= math.log(TINY_VOCAB) + 1e-4  # flat logits
    for event in watch.events:
        assert event.evidence["fixes"] == ["lower-learning-rate", "add-warmup", "enable-grad-clipping"]
    assert "step 2" in dead.message and "exploded at step 1" in dead.message


def test_healthy_sft_run_stays_quiet(tmp_path):
    trainer = sft_trainer(tmp_path, learning_rate=1e-3, steps=40)
    watch = nbguard.watch(trainer, verify=False)
    trainer.train()
    assert watch.events == [] and watch.step == 40


def warmup_to(tmp_path, learning_rate: float, steps: int, policy: str = "warn", every: int = 50):
    """TRL's SFT with a 20-step warmup to ``learning_rate``: at 1.0 the loss climbs for 15 steps, no single
    step's gradient norm far from the last (the slow form of an LR blow-up, as TRL's sft.py showed)."""
    from nbguard.watcher import RewindSettings

    trainer = sft_trainer(tmp_path, learning_rate=learning_rate, steps=steps)
    trainer.args.lr_scheduler_type, trainer.args.warmup_steps = "constant_with_warmup", 20
    watch = nbguard.watch(trainer, verify=False, policy=policy, rewind=RewindSettings(every=every))
    trainer.train()
    return watch, [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def test_a_warmup_to_an_lr_far_too_high_is_one_climb_event(tmp_path):
    watch, losses = warmup_to(tmp_path, learning_rate=1.0, steps=40)
    (event,) = watch.events
    climb = event.evidence["loss_climb"]
    assert event.kind == "divergence" and "the loss climbed from" in event.message
    # the claim against the run's own log (the watch's step k is the log's step k + 1)
    window = sorted(losses[event.step - 4:event.step + 1])
    assert climb["loss_level"] == pytest.approx(window[2])
    assert climb["loss_level"] >= 2 * climb["low_loss_level"] and climb["loss_level"] > climb["start_loss_level"]
    assert climb["start_loss_level"] == pytest.approx(sorted(losses[:5])[2])
    assert climb["grad_norm_ratio"] >= 2
    assert 0 < event.evidence["began_at_step"] < event.step
    assert event.evidence["fixes"] == ["lower-learning-rate", "add-warmup", "enable-grad-clipping"]


def test_the_same_warmup_to_a_workable_lr_is_quiet(tmp_path):
    watch, losses = warmup_to(tmp_path, learning_rate=1e-2, steps=60)
    assert watch.events == [] and len(losses) == 60


def test_rewind_goes_back_to_before_the_climb_and_halves_the_lr(tmp_path):
    """Snapshots every 5 steps in two slots: the newest ones are mid-climb, so the slot holding the state
    before it is kept (the other refilled), and the rewind restores that state."""
    watch, losses = warmup_to(tmp_path, learning_rate=1.0, steps=40, policy="rewind", every=5)
    climb = next(e for e in watch.events if e.kind == "divergence")
    rewind = climb.evidence["rewind"]
    assert rewind["restored"] and rewind["restored_after_step"] <= climb.evidence["began_at_step"] - 2
    assert rewind["lr_after"] == [pytest.approx(lr / 2) for lr in rewind["lr_before"]]
    _, unwatched = warmup_to(tmp_path, learning_rate=1.0, steps=40)
    assert losses[climb.step + 1] < 0.5 * unwatched[climb.step + 1]  # the first step on the restored state
    # the step's rows, replayed through TRL's fused-LM-head model (asked for logits), named by dataset index
    # with their share of the gradient norm and their text as the trainer's tokenizer decodes TRL's prepared row
    rows = climb.evidence["rows"]
    assert rows["rows_checked"] == 4 and "rows_error" not in climb.evidence
    dataset, tokenizer = watch.trainer.train_dataset, watch.trainer.processing_class
    for row in rows["rows"]:
        assert 0 < row["grad_share"] < 1 and row["excerpt"] == " ".join(
            tokenizer.decode(dataset[row["dataset_index"]]["input_ids"]).split())


def memorise(model, lr: float, steps: int):
    """One repeated batch: the loss falls over decades, and the gradient norm with it."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    watch = nbguard.watch(model, optimizer=opt, verify=False)
    return watch, [loss.item() for loss in train(model, opt, [tiny_batch(4, 16)] * steps)]


def test_a_memorising_run_stays_quiet():
    watch, losses = memorise(tiny_llama(), lr=1e-2, steps=80)
    norms = watch.history.to_dict()["total_grad_norm"]
    assert losses[-1] < 1e-3 < 1 < losses[0] and max(norms) / min(norms) > 1000  # three decades down
    assert watch.events == []


def test_a_memorising_24_layer_lora_run_stays_quiet():
    base = tiny_llama(num_hidden_layers=24, hidden_size=32, intermediate_size=64)
    watch, _ = memorise(get_peft_model(base, LoraConfig(r=8, target_modules=["q_proj", "v_proj"])), 0.1, 60)
    assert watch.events == []


def test_plain_loop_divergence_names_the_group():
    model = tiny_llama()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    watch = nbguard.watch(model, optimizer=opt, verify=False)
    for step in range(8):
        batch = tiny_batch(2, 12, seed=step)
        loss = model(**batch).loss
        if step == 5:  # an outlier term in the loss: a huge gradient on one block's MLP alone
            loss = loss + 1e4 * model.model.layers[1].mlp.down_proj.weight.square().sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
    (event,) = [e for e in watch.events if e.kind == "divergence"]
    assert event.step == 5 and event.evidence["exploded_groups"][0]["group"] == "model.layers.1.mlp"
    assert len(event.evidence["exploded_groups"]) == 1


def test_run_checks_can_be_turned_off(tmp_path):
    trainer = sft_trainer(tmp_path, learning_rate=1000.0, steps=8)
    watch = nbguard.watch(trainer, verify=False, config=nbguard.WatchConfig(run_checks={"enabled": False}))
    trainer.train()
    assert watch.events == []  # what the watch saw before: nothing
    with pytest.raises(TypeError, match="run_checks must be True or False"):
        nbguard.watch(tiny_llama(), optimizer=torch.optim.SGD(tiny_llama().parameters(), lr=0.1),
                      config=nbguard.WatchConfig(run_checks={"enabled": "yes"}))


def outlier_run(policy: str, steps: int = 8):
    """SGD on a tiny Llama; at step 5 an outlier term in the loss puts a huge gradient on one MLP."""
    model = tiny_llama()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    watch = nbguard.watch(model, optimizer=opt, verify=False, policy=policy)
    weights = []
    for step in range(steps):
        loss = model(**tiny_batch(2, 12, seed=step)).loss
        if step == 5:
            loss = loss + 1e4 * model.model.layers[1].mlp.down_proj.weight.square().sum()
        loss.backward()
        weights.append(model.model.layers[1].mlp.down_proj.weight.detach().clone())
        opt.step()
        opt.zero_grad()
        if step == 5:
            weights.append(model.model.layers[1].mlp.down_proj.weight.detach().clone())
    return watch, weights


def test_skip_drops_the_exploded_update_so_the_weights_stay_the_last_good_ones():
    watch, weights = outlier_run("skip")
    (event,) = [e for e in watch.events if e.kind == "divergence"]
    assert event.step == 5 and event.evidence["update_dropped"] is True
    assert torch.equal(weights[5], weights[6])  # the step-5 update never reached the weights
    assert watch.history.to_dict()["skipped_steps"] == [5]
    warned, warned_weights = outlier_run("warn")
    assert "update_dropped" not in warned.events[0].evidence
    assert not torch.allclose(warned_weights[5], warned_weights[6])


def test_stop_ends_the_loop_at_the_explosion():
    from nbguard.errors import NonFiniteError

    with pytest.raises(NonFiniteError, match="nbguard stopped training at step 5: gradient norm exploded"):
        outlier_run("stop")


# The quickstart's pure-fp16 Gemma 3 under AdamW as the Colab profile (transformers 5.9) trained it before
# its overflow was moved earlier: (grad norm, loss) per step, read from trainer.state.log_history.
COLAB_RAMP = [(3.059, 4.587), (3.246, 4.557), (28.02, 6.971), (106.7, 5.397), (178.0, 8.687), (78.06, 7.713),
              (79.75, 7.108), (68.31, 10.3)]


def _judge(steps) -> list[tuple[int, dict]]:
    from nbguard.watcher.detectors.divergence import DivergenceDetector

    detector = DivergenceDetector()
    return [(i, e) for i, (norm, loss) in enumerate(steps) if (e := detector.update(i, loss, norm, ["g"], [norm]))]


def test_a_ramp_each_step_absorbs_is_one_event_when_the_loss_rises_with_it():
    """x58 in four steps with the loss x1.9: no single step is far from the one before, so each entered the
    baseline; the ramp is judged from its lowest step."""
    [(step, evidence)] = _judge(COLAB_RAMP)
    assert step == 4 and evidence["ramp"]["from_step"] == 0
    assert evidence["ramp"]["grad_norm_ratio"] == pytest.approx(178.0 / 3.059)
    assert evidence["ramp"]["loss_ratio"] == pytest.approx(8.687 / 4.587)


def test_the_same_ramp_with_a_falling_loss_is_quiet():
    """A run that memorises can raise its gradient norm as much while its loss falls: no event."""
    falling = [(norm, 5.0 - 0.1 * i) for i, (norm, _) in enumerate(COLAB_RAMP)]
    assert _judge(falling) == []


def test_data_that_got_harder_is_reported_not_rewound():
    """A model that learned one row meets random rows, in dataset order: its gradient norm jumps 3.6 decades
    as an LR blow-up's does, yet nothing is damaged. Rewind asks the batch: the snapshot's weights do no
    better on it, so the update is dropped and no good step is thrown away."""
    from torch.utils.data import DataLoader

    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    easy = tiny_batch(1, 16, seed=0)
    for _ in range(30):  # learned before the watch: its loss starts near 0
        opt.zero_grad()
        model(**easy).loss.backward()
        opt.step()
    rows = [{k: v[0].clone() for k, v in easy.items()} for _ in range(40)]
    rows += [{k: v[0] for k, v in tiny_batch(1, 16, seed=100 + i).items()} for i in range(40)]
    loader = DataLoader(rows, batch_size=4, shuffle=False)
    watch = nbguard.watch(model, optimizer=opt, verify=False, policy="rewind")
    watch.track_rows(loader)
    for batch in loader:
        opt.zero_grad()
        model(**batch).loss.backward()
        opt.step()
    first = next(e for e in watch.events if e.kind == "divergence")
    assert first.step == 10  # the first hard rows
    check = first.evidence["damage_check"]
    assert check["damaged"] is False and check["snapshot_loss"] > 0.5 * check["current_loss"] > 1
    assert first.evidence["rewind"]["restored"] is False and "does no better" in first.evidence["rewind"]["reason"]
    assert not [e for e in watch.events if e.kind == "rewind"]
    # the diagnosis says so: the batch, not the learning rate; clipping (which bounds one batch) offered first
    assert "the batch's rows, not the weights or the learning rate, are the likely cause" in first.message
    assert first.evidence["fixes"][0] == "enable-grad-clipping" and "lower-learning-rate" in first.evidence["fixes"]
