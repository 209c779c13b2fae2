"""``WatchSettings(read="deferred")`` (issue 45): the verdict stays on the device, a non-finite update is
skipped by the fused optimizer's own ``found_inf``, and the numbers are judged a step late. Every claim
is checked against the host-read watch and an unwatched twin of the same seed."""
from __future__ import annotations

import contextlib
import warnings

import pytest
import torch

import nbguard
from nbguard.watcher import WatchSettings


class Dome(torch.nn.Module):
    """About the identity for |h| well below 1e6; NaN beyond it: a fault the data sets off at one step,
    in one module, that a replay of that step's batch sets off again."""

    def forward(self, h):
        return h + (torch.sqrt(1e12 - h * h) - 1e6)


class TwoLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.dome = Dome()
        self.b = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.relu(self.dome(self.a(x))))


def _train(*, read: str | None, policy: str = "warn", fused: bool = True, plant_at: int | None = None,
           spike_at: int | None = None, steps: int = 8, keep: list | None = None):
    """A loop whose loss is computed after the model; ``read`` None: unwatched. At ``plant_at`` the data is
    scaled 1e7 (``dome`` turns it NaN); at ``spike_at`` 1e4 (finite: an explosion). ``keep`` gets the model (a run that raises)."""
    torch.manual_seed(0)
    model = TwoLayers()
    if keep is not None:
        keep.append(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=fused)
    watch = None
    if read is not None:
        watch = nbguard.watch(model, optimizer=opt, policy=policy, log_to=None, verify=False,
                              settings=WatchSettings(read=read))
    data = torch.Generator().manual_seed(1)
    for step in range(steps):
        x, y = torch.randn(4, 8, generator=data), torch.randn(4, 4, generator=data)
        if spike_at == step:
            x = x * 1e4
        if plant_at == step:
            x = x * 1e7
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return model, watch


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("policy", ["warn", "skip"])
def test_a_healthy_run_is_bit_identical_quiet_and_has_every_step(policy):
    twin, _ = _train(read=None)
    host_model, host = _train(read="host", policy=policy)
    model, watch = _train(read="deferred", policy=policy)
    assert _same(model, twin) and _same(host_model, twin)
    watch.detach()
    host.detach()
    assert watch.events == [] and watch.step == 8
    assert watch.history.loss == host.history.loss  # the same numbers, a step later
    assert watch.history.total_grad_norm == host.history.total_grad_norm


def test_skip_drops_the_nonfinite_update_on_the_device_and_localises_it_at_its_step():
    host_model, host = _train(read="host", policy="skip", plant_at=3)
    model, watch = _train(read="deferred", policy="skip", plant_at=3)
    watch.detach()
    host.detach()
    # the fused AdamW skipped step 3 on the device: weights, moments and step counts as the host mode left them
    assert _same(model, host_model)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    (event,) = [e for e in watch.events if e.kind.startswith("nonfinite")]
    (expected,) = [e for e in host.events if e.kind.startswith("nonfinite")]
    assert (event.kind, event.step, event.origins[0].module) == \
        (expected.kind, expected.step, expected.origins[0].module) == ("nonfinite-loss", 3, "dome")
    assert watch.history.skipped_steps == host.history.skipped_steps == [3]


def test_stop_ends_the_loop_a_step_late_with_the_weights_of_before_the_bad_step():
    before_bad, _ = _train(read=None, steps=3)  # the weights steps 0-2 left
    kept: list = []
    with pytest.raises(nbguard.NonFiniteError, match="step 3"):
        _train(read="deferred", policy="stop", plant_at=3, keep=kept)
    # step 3's update was skipped on the device; the stop came at step 4's boundary, before its update
    assert _same(kept[0], before_bad)


def test_warn_reports_the_step_late_and_says_why_it_did_not_replay():
    _, watch = _train(read="deferred", policy="warn", plant_at=3)
    watch.detach()
    event = next(e for e in watch.events if e.kind.startswith("nonfinite"))
    assert event.step == 3 and event.kind == "nonfinite-loss"
    assert "read a step late" in event.evidence["not_replayed"]


@pytest.mark.parametrize("policy", ["skip", "stop"])
def test_a_divergence_is_dropped_on_the_device_at_its_step_as_the_host_mode_drops_it(policy):
    """The explosion test of the step in flight runs on the device, against the bounds the steps judged so far
    set: the exploded update is skipped by the fused AdamW before it is applied, as the host mode drops it."""
    host_kept: list = []
    kept: list = []
    with _stopping(policy):
        host_model, host = _train(read="host", policy=policy, spike_at=8, steps=12, keep=host_kept)
    with _stopping(policy):
        model, watch = _train(read="deferred", policy=policy, spike_at=8, steps=12, keep=kept)
    host_model, model = host_kept[0], kept[0]
    assert _same(model, host_model)  # weights, and (under skip) every later step's, bit for bit
    if policy == "skip":
        host.detach()
        watch.detach()
        assert [(e.kind, e.step) for e in watch.events] == [(e.kind, e.step) for e in host.events] \
            == [("divergence", 8)]
        assert watch.events[0].evidence["update_dropped"] is True
        assert "next_update_dropped" not in watch.events[0].evidence
        assert watch.history.skipped_steps == host.history.skipped_steps == [8]


def _stopping(policy: str):
    return pytest.raises(nbguard.NonFiniteError, match="step 8") if policy == "stop" else contextlib.nullcontext()


def test_a_policy_that_drops_updates_without_a_device_skip_reads_on_the_host_and_says_so():
    twin, host = _train(read="host", policy="skip", fused=False, plant_at=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, watch = _train(read="deferred", policy="skip", fused=False, plant_at=3)
    said = [str(w.message) for w in caught if "read='deferred' is not possible" in str(w.message)]
    assert len(said) == 1 and "AdamW has no device-side skip" in said[0]
    assert _same(model, twin)
    assert [(e.kind, e.step) for e in watch.events] == [(e.kind, e.step) for e in host.events]


def test_bad_read_mode_is_a_clear_error():
    with pytest.raises(ValueError, match="read='late'.*'host'.*'deferred'"):
        WatchSettings(read="late")


def test_rewind_a_step_late_still_rescues_a_blow_up_of_a_loss_computed_outside_the_model():
    """The torchtune-style recipe of test_closure_steps (LR x1000 for three steps), read a step late: the
    divergence at its step, the rewind one step later, the run back within 25% of the healthy one."""
    from test_closure_steps import _recipe

    healthy, _ = _recipe(watched=False, fused=True)
    seen: list[float] = []
    rescued, watch = _recipe(watched=True, policy="rewind", blow_up=(20, 21, 22), read="deferred", fused=True,
                             lr_seen=seen)
    divergence = next(e for e in watch.events if e.kind == "divergence")
    assert divergence.step in (20, 21) and divergence.evidence["next_update_dropped"]
    rewind = next(e for e in watch.events if e.kind == "rewind")
    # the LR held at the cut one after the rewind, judged a step late too: the blow-up's later steps ran under it
    held = rewind.evidence["lr_held"]
    assert held["at_most"] == [pytest.approx(3e-3 * 0.5)]
    assert max(seen[rewind.step + 1:held["through_step"] + 1]) == pytest.approx(3e-3 * 0.5)
    assert rescued[-1] <= 1.25 * healthy[-1], (rescued[-1], healthy[-1])
