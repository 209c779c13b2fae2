"""A failed attach leaves nothing behind; the guard's own error path never raises into user code."""
from __future__ import annotations

import warnings

import pytest
import torch
from watch_helpers import batches, hook_counts

import nbguard
from nbguard.testing import tiny_llama
from nbguard.watcher import Detector


def test_bad_scaler_is_refused_before_any_hook():
    model = tiny_llama()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = hook_counts(model, opt)
    with pytest.raises(TypeError, match=r"scaler must be a torch\.amp\.GradScaler .* got str"):
        nbguard.watch(model, optimizer=opt, scaler="not a scaler")
    assert hook_counts(model, opt) == before


def test_attach_failing_midway_rolls_back_every_hook():
    """An error after some hooks are registered (here: the optimizer binding) removes them all."""
    model = tiny_llama()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = hook_counts(model, opt)

    class RefusesHooks(Exception):
        pass

    def refuse(*args, **kwargs):
        raise RefusesHooks("this optimizer takes no step hooks")

    opt.register_step_pre_hook = refuse  # a wrapper optimizer that cannot be hooked
    with pytest.raises(RefusesHooks):
        nbguard.watch(model, optimizer=opt, activations=True)
    del opt.register_step_pre_hook
    assert hook_counts(model, opt) == before
    watch = nbguard.watch(model, optimizer=opt)  # and a later attach works as usual
    assert watch.active
    watch.detach()
    assert hook_counts(model, opt) == before


class BrokenDetector(Detector):
    def update(self, view):
        raise RuntimeError("a detector bug")


def test_internal_failure_under_warnings_as_errors_never_raises_into_the_step():
    torch.manual_seed(0)
    model = tiny_llama()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    watch = nbguard.watch(model, optimizer=opt, detectors=[BrokenDetector()], verify=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for batch in batches(3):
            opt.zero_grad()
            model(**batch).loss.backward()
            opt.step()  # the detector fails inside the step-end hook: the guard steps aside quietly
    assert [e.kind for e in watch.events] == ["watch-error"]
    assert "a detector bug" in watch.events[0].message and not watch.active


def test_backward_hook_failure_under_warnings_as_errors(monkeypatch):
    from nbguard.watcher.reads import sentinel

    def broken(self, values):
        raise RuntimeError("norm read failed")

    torch.manual_seed(0)
    model = tiny_llama()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    watch = nbguard.watch(model, optimizer=opt, verify=False)
    monkeypatch.setattr(sentinel.GradNormCollector, "_host_group_norms", broken)  # the norm read's own work fails
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(**batches(1)[0]).loss.backward()
        opt.step()
    assert [e.kind for e in watch.events] == ["watch-error"] and not watch.active


def test_a_watch_that_fails_after_the_last_forward_gives_torch_its_clip_back_at_once():
    """Its hooks wait for a safe point (the next forward, which a finished loop never runs), but the
    global clip_grad_norm_ wrapper is released when the failure happens: later runs do not pay it."""
    from nbguard.watcher.reads import clip_tap

    torch.manual_seed(0)
    model = tiny_llama()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    watch = nbguard.watch(model, optimizer=opt, detectors=[BrokenDetector()], verify=False)
    model(**batches(1)[0]).loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    assert clip_tap.tapped()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt.step()  # the detector fails in the step-end hook (not a safe point: the hooks stay)
    assert not watch.active and watch.attached and not clip_tap.tapped()
    watch.detach()


def test_a_failure_in_a_tap_on_the_users_objects_is_the_watchs_error_not_a_stray_warning(monkeypatch):
    """The GradScaler's update tap failing in nbguard's part: one watch-error event, the watch steps aside,
    and the user's update still runs (the scale moves as it would unwatched). It was only warned."""
    from nbguard.watcher.core.steps import WatchSteps

    def broken(self):
        raise RuntimeError("planted failure before the scaler's update")

    monkeypatch.setattr(WatchSteps, "_before_scaler_update", broken)
    torch.manual_seed(0)
    model = tiny_llama()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=1)
    watch = nbguard.watch(model, optimizer=opt, scaler=scaler, verify=False, log_to=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no stray warning either
        for batch in batches(2):
            opt.zero_grad()
            scaler.scale(model(**batch).loss).backward()
            scaler.step(opt)
            scaler.update()
    assert [e.kind for e in watch.events] == ["watch-error"]
    assert "planted failure" in watch.events[0].message and not watch.active
    assert scaler.get_scale() == 2.0 ** 10  # both updates ran: growth_interval=1 doubled it twice
