"""warn / skip / stop, and the arguments the watch refuses."""
import math

import pytest
import torch
from watch_helpers import PoisonedSiLU, batches, identical, snapshot, train, with_token

import nbguard
from nbguard.testing import tiny_llama

torch.set_num_threads(1)


def _run(model, opt, data, poisoned_step=1):
    """Train; the backward of layer 0's MLP makes NaN at ``poisoned_step`` only."""
    act = model.model.layers[0].mlp.act_fn = PoisonedSiLU(armed=False)
    states = []
    for i, batch in enumerate(data):
        act.armed = i == poisoned_step
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad()
        states.append(snapshot(model))
    return states


def _all_finite(model):
    return all(torch.isfinite(p).all() for p in model.parameters())


def test_warn_lets_the_nan_update_through():
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with nbguard.watch(model, optimizer=opt) as watch:
        _run(model, opt, batches(3))
    # the NaN update went through, so step 2 is bad too: one event, counted as a streak
    assert [(e.kind, e.step) for e in watch.events] == [("nonfinite-grad", 1)]
    assert watch.events[0].evidence["consecutive_bad_steps"] == 2
    assert not _all_finite(model)


def test_skip_keeps_every_weight_finite_and_training_goes_on():
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with nbguard.watch(model, optimizer=opt, policy="skip") as watch:
        states = _run(model, opt, batches(4))
    assert _all_finite(model)
    assert [(e.kind, e.step) for e in watch.events] == [("nonfinite-grad", 1)]
    assert identical(states[0], states[1])  # the bad update moved nothing
    assert not identical(states[1], states[2])  # later good steps train
    assert {float(s["step"]) for s in opt.state.values()} == {3.0}  # AdamW's step count skipped one too
    assert watch.history.skipped_steps == [1] and watch.step == 4


def test_stop_in_a_plain_loop_raises_after_keeping_the_last_good_weights():
    model = tiny_llama()
    with torch.no_grad():
        model.model.embed_tokens.weight[7] = float("nan")
    data = batches(4, avoid=7)
    data[2] = with_token(data[2], 7)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    done = []
    with nbguard.watch(model, optimizer=opt, policy="stop") as watch:
        with pytest.raises(nbguard.NonFiniteError) as info:
            for batch in data:
                model(**batch).loss.backward()
                good = snapshot(model)
                opt.step()
                opt.zero_grad()
                done.append(1)
    assert len(done) == 2 and watch.step == 3
    assert identical(good, snapshot(model))
    assert info.value.event is watch.events[0] and info.value.event.cause == "nonfinite-parameter"
    assert "step 2" in str(info.value)
    assert all(p.grad is None for p in model.parameters())


def test_localize_false_still_detects_without_replay():
    model = tiny_llama()
    model.model.layers[0].mlp.act_fn = PoisonedSiLU()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with nbguard.watch(model, optimizer=opt, localize=False) as watch:
        train(model, opt, batches(2))
    assert [e.kind for e in watch.events] == ["nonfinite-grad"]
    assert watch.events[0].origins == [] and watch.events[0].evidence["consecutive_bad_steps"] == 2
    assert math.isnan(watch.history.total_grad_norm[0])


def test_bad_arguments_are_refused_clearly():
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="warn, skip, stop"):
        nbguard.watch(model, optimizer=opt, policy="ignore")
    with pytest.raises(ValueError, match="optimizer="):
        nbguard.watch(model)
    with pytest.raises(TypeError, match="target"):
        nbguard.watch("model", optimizer=opt)
    with pytest.raises(TypeError, match="optimizer"):
        nbguard.watch(model, optimizer=object())


def test_across_ranks_the_policy_acts_only_on_agreed_detectors():
    """A rank's own verdict (the run checks' divergence) only reports under DDP: the ranks could
    disagree and apply different updates. An agreed detector's events (the GradScaler streak) act."""
    from nbguard.findings import Event
    from nbguard.watcher.components.run_checks import RunChecks
    from nbguard.watcher.detectors.scaler_skips import ScalerSkips
    from nbguard.watcher.detectors.thresholds import WatchSettings
    from nbguard.watcher.policy.policies import training_stopper, update_dropper

    checks = RunChecks(None)
    exploded = Event("divergence", 3, "gradient norm exploded", evidence={})
    for policy, one_process in (("warn", None), ("skip", exploded), ("stop", exploded)):
        assert update_dropper(policy, [(checks, exploded)], across_ranks=False) is one_process
        assert update_dropper(policy, [(checks, exploded)], across_ranks=True) is None
    skips = ScalerSkips(WatchSettings(), lambda kind, extra, budget: Event(kind, 0, kind, evidence=dict(extra)))
    streak = Event("skipped-steps", 8, "GradScaler skipped 8 optimizer steps in a row", evidence={})
    assert training_stopper("stop", [(checks, exploded), (skips, streak)], across_ranks=True) is streak
    assert training_stopper("skip", [(skips, streak)], across_ranks=True) is None
    assert update_dropper("stop", [(skips, streak)], across_ranks=False) is None  # a skip streak drops nothing
