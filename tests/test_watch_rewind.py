"""policy="rewind": snapshots every few steps, restored in place on trouble (tiny models, CPU)."""
import copy
import math
import warnings

import pytest
import torch
from notebook_helpers import shell  # noqa: F401  (the fixture)
from watch_helpers import PoisonedSiLU

import nbguard
from nbguard.errors import NonFiniteError
from nbguard.testing import tiny_batch, tiny_llama
from nbguard.watcher import RewindSettings

torch.set_num_threads(1)

LR = 1e-3
DATA = [tiny_batch(4, 16, seed=i) for i in range(16)]


def _scheduled_loop(schedule, policy=None, steps=100, every=5, scaler=None, lr_seen=None):
    """A plain loop whose LR follows ``schedule`` (a LambdaLR factor of LR); each step's loss, the watch, and
    (model, optimizer, scheduler)."""
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    watch = nbguard.watch(model, optimizer=opt, policy=policy, scheduler=sched, scaler=scaler, verify=False,
                          rewind=RewindSettings(every=every)) if policy else None
    if lr_seen is not None:  # the LR each update runs at (after the watch's own pre-step hook)
        opt.register_step_pre_hook(lambda o, args, kwargs: lr_seen.append(o.param_groups[0]["lr"]))
    losses = []
    for i in range(steps):
        loss = model(**DATA[i % len(DATA)]).loss
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(loss.item())
    if watch is not None:
        watch.detach()
    return losses, watch, (model, opt, sched)


def _spiked_loop(policy=None, spike=True, steps=100, every=5, scaler=None, spike_steps=3, lr_seen=None):
    """The LR at 1.0 for steps 20-22 (``spike_steps`` from 20); the mean loss of the last 10 steps, and the watch."""
    losses, watch, objects = _scheduled_loop(
        lambda s: (1.0 / LR) if spike and 20 <= s < 20 + spike_steps else 1.0,
        policy=policy, steps=steps, every=every, scaler=scaler, lr_seen=lr_seen)
    return sum(losses[-10:]) / 10, watch, objects


def test_rewind_recovers_a_run_an_lr_spike_ruined():
    healthy, _, _ = _spiked_loop(spike=False)
    ruined, _, _ = _spiked_loop()
    skipped, _, _ = _spiked_loop(policy="skip")
    rewound, watch, (model, opt, sched) = _spiked_loop(policy="rewind")
    assert ruined > 1.25 * healthy and skipped > 1.25 * healthy  # the spike ruins the run, skip does not save it
    assert math.isfinite(rewound) and abs(rewound - healthy) <= 0.25 * healthy
    rewinds = [e for e in watch.events if e.kind == "rewind"]
    assert rewinds and all(e.evidence["restored"] for e in rewinds)
    first = rewinds[0].evidence
    assert first["trigger"] == "divergence" and first["trigger_step"] >= 21
    assert first["restored_after_step"] <= 19  # before the first update at LR 1.0 (step 20)
    assert first["batches_skipped"] == rewinds[0].step - first["restored_after_step"]
    assert first["lr_after"] == [pytest.approx(lr * 0.5) for lr in first["lr_before"]]
    assert sched.base_lrs[0] == pytest.approx(LR * 0.5 ** len(rewinds))  # the cut reached the schedule
    assert "rewound to the state after step" in rewinds[0].message and "lr x0.5" in rewinds[0].message
    [divergence] = [e for e in watch.events if e.kind == "divergence" and e.step == first["trigger_step"]]
    rows = divergence.evidence["rows"]  # the step's rows by loss, highest first (all finite: suspects only)
    assert rows["nonfinite"] is False and rows["rows_checked"] == 4 and len(rows["rows"]) == 3
    assert rows["rows"][0]["loss"] >= rows["rows"][-1]["loss"] > 2 * healthy
    # the history records them, and the watch's document carries them
    assert [r["step"] for r in watch.rewinds] == [e.step for e in rewinds]
    assert watch.to_document()["history"]["rewinds"] == watch.rewinds


def test_after_a_divergence_rewind_the_lr_is_held_at_the_restored_states_cut_lr_while_a_spike_goes_on():
    """LR 1.0 for steps 20-25: rewound at 21, the LR cut; the schedule still sets 1000x for four more steps. For
    ``every`` steps after the rewind no group's LR goes above the restored state's LR x lr_factor, so the spike
    does no damage again: one rewind, the run back within 25% of the healthy one (without the hold a second
    rewind to the same state cut the LR again: 4.37 against the healthy 3.59)."""
    healthy, _, _ = _spiked_loop(spike=False)
    seen: list[float] = []
    rewound, watch, (_, opt, sched) = _spiked_loop(policy="rewind", spike_steps=6, lr_seen=seen)
    [rewind] = [e for e in watch.events if e.kind == "rewind"]
    held = rewind.evidence["lr_held"]
    assert held == {"at_most": [pytest.approx(LR * 0.5)], "through_step": rewind.step + 5,
                    "longer_while_schedule_over": [pytest.approx(LR * 5)], "at_latest_through_step": rewind.step + 25}
    assert f"at most {LR * 0.5:.3g} through step {rewind.step + 5} (longer while" in rewind.message
    # the LR each update ran at: capped through the window (the schedule asked for 0.5), then the schedule's own;
    # after each update the LR is the schedule's again (what a chainable schedule goes on from)
    assert max(seen[rewind.step + 1:rewind.step + 6]) == pytest.approx(LR * 0.5)
    assert seen[rewind.step + 6] == pytest.approx(sched.base_lrs[0]) == pytest.approx(LR * 0.5)
    assert opt.param_groups[0]["lr"] == sched.get_last_lr()[0]
    assert abs(rewound - healthy) <= 0.25 * healthy



def test_a_spike_longer_than_the_hold_window_is_held_until_it_has_passed():
    """LR 1.0 for steps 20-29, longer than the 5-step hold after the rewind at 21. The hold stays on while the
    schedule asks for over 10x the cut LR, so no update runs spiked and no snapshot is taken after a spiked update:
    one rewind, the run within 25% of the healthy one. With the hold ending at its window, steps 27-29 ran at 0.5,
    a snapshot after step 27 was taken and rewound to, the LR cut twice: 4.69 against the healthy 3.59."""
    healthy, _, _ = _spiked_loop(spike=False)
    seen: list[float] = []
    rewound, watch, (_, _, sched) = _spiked_loop(policy="rewind", spike_steps=10, lr_seen=seen)
    assert abs(rewound - healthy) <= 0.25 * healthy
    [rewind] = [e for e in watch.events if e.kind == "rewind"]
    assert max(seen[rewind.step + 1:]) == pytest.approx(LR * 0.5) == pytest.approx(sched.base_lrs[0])
    # the snapshots taken under the hold, while the schedule still asked for 0.5 (the run stopped at step 29), record
    # the LR their updates ran at: a later rewind holds and cuts from there
    _, during, _ = _spiked_loop(policy="rewind", spike_steps=10, steps=30)
    assert sorted((slot.after_step, slot.lr) for slot in during._rewinder.slots) == [
        (rewind.step + 1, [pytest.approx(LR * 0.5)]), (rewind.step + 6, [pytest.approx(LR * 0.5)])]


def _warmup_loop(policy=None, steps=40):
    """A healthy run whose LR warms up linearly from 0 over 30 steps (as transformers' linear warmup does)."""
    losses, watch, (model, _, _) = _scheduled_loop(lambda s: min(1.0, s / 30), policy=policy, steps=steps)
    return losses, model, watch


def test_a_healthy_warmup_run_keeps_its_snapshots_and_trains_as_its_unwatched_twin():
    """The LR rising 5x and more between snapshots (from 0) is no spike: every due snapshot is taken, at the LR the
    warmup set, and the watched run is bit for bit its unwatched twin (refusing snapshots while the LR is over 10x
    the last one's kept a single snapshot here, the one at LR 0)."""
    losses, model, watch = _warmup_loop("rewind")
    twin_losses, twin, _ = _warmup_loop()
    assert not [e for e in watch.events if e.kind == "rewind"]
    assert watch._rewinder.taken == 8  # after steps 0, 5, ..., 35
    assert sorted((slot.after_step, slot.lr[0]) for slot in watch._rewinder.slots) == [
        (30, pytest.approx(LR)), (35, pytest.approx(LR))]
    assert losses == twin_losses
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters(), strict=True))


def _poisoned_weights_loop(policy, bad_after=12, steps=20, every=5, **settings):
    """Weights turn inf after step ``bad_after``'s update (a loop bug, a kernel writing inf); records the
    weights and optimizer state after every update."""
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    held = model.model.layers[0].mlp.up_proj.weight  # a reference the user holds
    watch = nbguard.watch(model, optimizer=opt, policy=policy, verify=False,
                          rewind=RewindSettings(every=every, **settings))
    states = {}
    for i in range(steps):
        model(**DATA[i % len(DATA)]).loss.backward()
        opt.step()
        opt.zero_grad()
        if i == bad_after:
            with torch.no_grad():
                held[0, 0] = float("inf")
        states[i] = ({k: v.detach().clone() for k, v in model.named_parameters()},
                     copy.deepcopy(opt.state[held]))
    watch.detach()
    return watch, model, opt, held, states


def test_rewind_restores_weights_and_optimizer_state_in_place():
    watch, model, opt, held, states = _poisoned_weights_loop("rewind")
    [bad] = [e for e in watch.events if e.kind == "nonfinite-loss"]
    [rewind] = [e for e in watch.events if e.kind == "rewind"]
    assert bad.step == 13 and bad.cause == "nonfinite-parameter"
    assert rewind.evidence["restored_after_step"] == 10 and rewind.evidence["batches_skipped"] == 3
    assert rewind.evidence["lr_after"] == rewind.evidence["lr_before"]  # not a divergence: the LR stays
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert model.model.layers[0].mlp.up_proj.weight is held  # the same tensors, restored in place
    # right after the rewind the weights and moments were those after step 10; step 13's update was
    # dropped, and steps 14-19 trained on from there: replay that from the recorded state
    params, moments = states[10]
    after_13 = states[13]
    assert all(torch.equal(after_13[0][k], v) for k, v in params.items())
    assert torch.equal(after_13[1]["exp_avg"], moments["exp_avg"])
    assert torch.equal(after_13[1]["exp_avg_sq"], moments["exp_avg_sq"])
    assert float(after_13[1]["step"]) == float(moments["step"]) == 11.0
    assert watch.step == 20 and watch.history.skipped_steps == [13]


def test_skip_cannot_save_weights_that_are_already_inf():
    watch, model, *_ = _poisoned_weights_loop("skip")
    assert not all(torch.isfinite(p).all() for p in model.parameters())
    assert not [e for e in watch.events if e.kind == "rewind"]


def test_rewinds_stop_after_the_most_allowed():
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    watch = nbguard.watch(model, optimizer=opt, policy="rewind", verify=False,
                          rewind=RewindSettings(every=2, max_rewinds=1))
    with pytest.raises(NonFiniteError, match=r"rewound 1 time\(s\), the most allowed"):
        for i in range(30):
            model(**DATA[i % len(DATA)]).loss.backward()
            opt.step()
            opt.zero_grad()
            if i in (6, 12):
                with torch.no_grad():
                    model.lm_head.weight[0, 0] = float("nan")
    watch.detach()
    kinds = [(e.step, e.kind) for e in watch.events]
    assert kinds[:2] == [(7, "nonfinite-loss"), (7, "rewind")] and (13, "rewind") in kinds
    assert watch.stop_requested and all(torch.isfinite(p).all() for p in model.parameters())


def test_a_blip_the_replay_cannot_reproduce_is_skipped_not_rewound():
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)

    class OneShot(PoisonedSiLU):  # NaN in the backward of one training forward, never again (nor in the replay)
        def forward(self, x):
            out = super().forward(x)
            self.armed = False
            return out

    act = model.model.layers[0].mlp.act_fn = OneShot(armed=False)
    watch = nbguard.watch(model, optimizer=opt, policy="rewind", verify=False, rewind=RewindSettings(every=2))
    for i in range(10):
        act.armed = i == 6
        model(**DATA[i]).loss.backward()
        opt.step()
        opt.zero_grad()
    watch.detach()
    [bad] = [e for e in watch.events if e.kind == "nonfinite-grad"]
    assert bad.step == 6 and bad.cause == "not-reproducible"
    assert bad.evidence["rewind"]["restored"] is False and "blip" in bad.evidence["rewind"]["reason"]
    assert not [e for e in watch.events if e.kind == "rewind"] and watch.history.skipped_steps == [6]


def test_rewind_that_does_not_fit_the_budget_says_so_and_skips():
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    with pytest.warns(RuntimeWarning, match="policy rewind is off"):
        watch = nbguard.watch(model, optimizer=opt, policy="rewind", verify=False,
                              rewind=RewindSettings(budget_bytes=100_000))
    [event] = watch.events
    assert event.kind == "rewind" and event.evidence["available"] is False and "GiB" in event.message
    assert watch.policy == "skip"
    watch.detach()


def test_rewind_settings_refuse_nonsense():
    with pytest.raises(ValueError, match="lr_factor"):
        RewindSettings(lr_factor=2.0)
    with pytest.raises(ValueError, match="every"):
        RewindSettings(every=0)
    with pytest.raises(ValueError, match="schedule"):
        RewindSettings(schedule="later")
    with pytest.raises(TypeError, match="RewindSettings"):
        nbguard.watch(tiny_llama(), optimizer=torch.optim.SGD(tiny_llama().parameters(), lr=0.1),
                      policy="rewind", rewind={"every": 5})


def test_a_failing_snapshot_never_breaks_the_run(monkeypatch):
    from nbguard.watcher.policy import rewind

    def broken(*args, **kwargs):
        raise RuntimeError("planted")

    monkeypatch.setattr(rewind.Snapshot, "fill", broken)
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        watch = nbguard.watch(model, optimizer=opt, policy="rewind", verify=False)
        for i in range(3):
            model(**DATA[i]).loss.backward()
            opt.step()
            opt.zero_grad()
    assert [e.kind for e in watch.events] == ["watch-error"] and "planted" in watch.events[0].message
    assert not watch.active
    watch.detach()


def test_nanwatch_cell_with_policy_rewind_restores_the_weights(shell):  # noqa: F811
    from notebook_helpers import MIME, run

    run(shell, "import torch\nfrom nbguard.testing import tiny_llama, tiny_batch\nnet = tiny_llama()\n"
               "opt = torch.optim.AdamW(net.parameters(), lr=1e-3)\nbatch = tiny_batch()\n"
               "%config NbguardMagics.verify_fixes = False\n")
    loop = "for i in range(8):\n    opt.zero_grad()\n    net(**batch).loss.backward()\n    opt.step()\n" \
           "    if i == 4:\n        with torch.no_grad():\n            net.lm_head.weight[0, 0] = float('nan')\n"
    cell = run(shell, "%%nanwatch net --policy rewind\n" + loop)
    assert "(policy rewind)" in cell.stdout  # the line under the view; the rewind is in the view
    view = cell.updates[-1]
    assert "rewound to the state after step 0" in view["text/plain"]
    [entry] = view[MIME]["history"]["rewinds"]
    assert entry["restored_after_step"] == 0
    net = shell.user_ns["net"]
    assert all(torch.isfinite(p).all() for p in net.parameters())


def test_rewinds_reach_the_document_and_its_views():
    jsonschema = pytest.importorskip("jsonschema")
    from nbguard.document.schema import schema

    watch, *_ = _poisoned_weights_loop("rewind")
    bundle = watch._repr_mimebundle_()
    data = bundle["application/vnd.nbguard.v1+json"]
    jsonschema.Draft202012Validator(schema()).validate(data)
    [entry] = data["history"]["rewinds"] if "history" in data else data["watch"]["history"]["rewinds"]
    assert entry["step"] == 13 and entry["restored_after_step"] == 10 and entry["batches_skipped"] == 3
    assert "rewound to the state after step 10" in bundle["text/plain"]
    assert "rewound to the state after step 10" in bundle["text/html"]


def test_schedule_restore_puts_the_scheduler_back_too():
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    watch = nbguard.watch(model, optimizer=opt, scheduler=sched, policy="rewind", verify=False,
                          rewind=RewindSettings(every=5, schedule="restore"))
    for i in range(14):
        model(**DATA[i]).loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        if i == 12:
            with torch.no_grad():
                model.lm_head.weight[0, 0] = float("inf")
            epoch_then = sched.last_epoch
    watch.detach()
    [rewind] = [e for e in watch.events if e.kind == "rewind"]
    assert rewind.evidence["restored_after_step"] == 10 and "LR scheduler" in rewind.evidence["what"]
    # restored to where it was at step 10's update (last_epoch 10: the snapshot is taken inside
    # optimizer.step, before the loop's scheduler.step()), then stepped by the loop after step 13: the
    # LR of step 11, the step that follows the restored weights
    assert epoch_then == 13 and sched.last_epoch == 11
    assert opt.param_groups[0]["lr"] == pytest.approx(LR / (1 + 11))


def test_under_a_gradscaler_rewind_acts_at_the_steps_end():
    """An enabled GradScaler decides on non-finite updates itself, so the divergence is judged after the
    update was applied: the rewind then restores over it, the scaler's scale included."""
    healthy, _, _ = _spiked_loop(spike=False)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    rewound, watch, _ = _spiked_loop(policy="rewind", scaler=scaler)
    assert abs(rewound - healthy) <= 0.25 * healthy
    [rewind, *_] = [e for e in watch.events if e.kind == "rewind"]
    assert rewind.evidence["trigger"] == "divergence" and "GradScaler scale" in rewind.evidence["what"]
    assert rewind.evidence["restored_after_step"] <= 19 and scaler.get_scale() == 2.0 ** 8


def _saturated_loop(policy=None, steps=16):
    """AdamW at 1e-3 on one batch; the schedule puts the LR at 1e4 for one step (step 3): that update saturates
    the logits, and from step 4 the gradient is exactly 0 and the loss ln(vocab) for ever (a dead run)."""
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1e7 if s == 3 else 1.0)
    watch = nbguard.watch(model, optimizer=opt, policy=policy, verify=False, scheduler=sched) if policy else None
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(**DATA[0]).loss
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    return watch, losses, sched


def test_a_run_that_learned_then_died_is_rewound_and_learns_again():
    _, dead, _ = _saturated_loop()
    watch, losses, sched = _saturated_loop("rewind")
    assert dead[4] == dead[-1] == pytest.approx(math.log(128), abs=1e-3)  # the unwatched run never learns again
    dead_run, rewind = watch.events  # and nothing else: no update "spike" read off the restore itself
    assert (dead_run.kind, rewind.kind) == ("dead-run", "rewind")
    assert dead_run.evidence["dead_since_step"] == 4
    assert rewind.evidence["restored_after_step"] <= 2 and rewind.evidence["lr_factor"] == 0.5
    assert sched.base_lrs[0] == pytest.approx(LR / 2)
    assert losses[-1] < losses[rewind.step + 1] < dead[-1]  # learning again, from the restored state
    assert losses[-1] < min(losses[:4])  # below anything before the bad update


def _has_colour(png: bytes, hex_colour: str) -> bool:
    """Whether the PNG has pixels of that colour (matplotlib's own reader; within 12 of 765 in RGB, so
    antialiased edges and the heatmap's own greens, 45 away at the closest, do not count)."""
    import io

    from matplotlib.image import imread

    pixels = (imread(io.BytesIO(png), format="png")[..., :3] * 255).round().astype(int)
    target = [int(hex_colour[i:i + 2], 16) for i in (1, 3, 5)]
    return bool((abs(pixels - target).sum(axis=-1) <= 12).sum() >= 20)


def test_rewinds_show_on_the_loss_and_heatmap_timelines():
    from nbguard.document.palette import REWIND_COLOR
    from nbguard.render import heatmap_png, series_png

    watch, *_ = _poisoned_weights_loop("rewind")
    history = watch.history.to_dict()
    assert [r["step"] for r in history["rewinds"]] == [13]
    without = {k: v for k, v in history.items() if k != "rewinds"}
    for draw in (series_png, heatmap_png):
        assert _has_colour(draw(history), REWIND_COLOR), draw.__name__
        assert not _has_colour(draw(without), REWIND_COLOR), draw.__name__  # the colour is the rewind's alone
