"""Steps whose forward and backward run inside ``optimizer.step(closure)`` (Lightning's automatic
optimization, LBFGS), and losses computed outside the model (``loss_fn(logits, y)``, as litgpt,
torchtune and most hand-written loops do): the watch reads each step after its backward and before
its update, with the loss ``backward()`` started from. Every claim is checked against an unwatched
twin run of the same seed."""
from __future__ import annotations

import inspect
import warnings

import pytest
import torch

import nbguard


class TwoLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _nan_in(module):
    return module.register_forward_hook(lambda mod, args, out: out * float("nan"))


def _train(*, watched: bool, closure: bool, optimizer=torch.optim.SGD, plant_at: int | None = None,
           steps: int = 6, policy: str = "warn", lr: float = 0.05, accumulate: int = 1, nan_target_at=None):
    """A loop computing its loss after the model; returns the model, the watch (or None) and, per
    step, the loss and total gradient norm the optimizer really stepped with."""
    torch.manual_seed(0)
    model = TwoLayers()
    opt = optimizer(model.parameters(), lr=lr)
    watch = nbguard.watch(model, optimizer=opt, policy=policy, log_to=None, verify=False) if watched else None
    data = torch.Generator().manual_seed(1)
    truth: list[tuple[float, float]] = []
    for step in range(steps):
        batches = [(torch.randn(4, 8, generator=data), torch.randn(4, 4, generator=data)) for _ in range(accumulate)]
        if nan_target_at == step:
            batches[0][1][0, 0] = float("nan")  # the data, not the model: the loss is NaN, every output finite
        hook = _nan_in(model.b) if plant_at == step else None

        def forward_backward(batches=batches):
            opt.zero_grad()
            total = 0.0
            for x, y in batches:
                loss = torch.nn.functional.mse_loss(model(x), y) / accumulate
                loss.backward()
                total += float(loss.detach())
            norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
            truth.append((total, float(norm)))
            return loss

        if closure:
            opt.step(forward_backward)
        else:
            forward_backward()
            opt.step()
        if hook is not None:
            hook.remove()
    if watch is not None:
        watch.detach()
    return model, watch, truth


@pytest.mark.parametrize("closure", [True, False], ids=["step(closure)", "backward-then-step"])
@pytest.mark.parametrize("optimizer", [torch.optim.SGD, torch.optim.AdamW], ids=["SGD", "AdamW"])
def test_healthy_run_is_read_at_its_own_step_and_left_bit_identical(closure, optimizer):
    twin, _, truth = _train(watched=False, closure=closure, optimizer=optimizer)
    model, watch, seen = _train(watched=True, closure=closure, optimizer=optimizer)
    assert seen == truth
    assert watch.events == []
    for mine, theirs in zip(model.parameters(), twin.parameters()):
        assert torch.equal(mine, theirs)
    # the loss made after the model is the step's loss, and the norms are this step's, not the last one's
    assert watch.history.loss == pytest.approx([loss for loss, _ in truth], rel=1e-6)
    assert watch.history.total_grad_norm == pytest.approx([norm for _, norm in truth], rel=1e-5)


def test_accumulated_shares_sum_to_the_step_loss():
    _, _, truth = _train(watched=False, closure=True, accumulate=3)
    _, watch, _ = _train(watched=True, closure=True, accumulate=3)
    assert watch.history.loss == pytest.approx([loss for loss, _ in truth], rel=1e-6)


@pytest.mark.parametrize("optimizer", [torch.optim.SGD, torch.optim.AdamW, torch.optim.LBFGS],
                         ids=["SGD", "AdamW", "LBFGS"])
def test_nan_planted_inside_a_closure_is_caught_at_its_step_and_module_and_skipped(optimizer):
    model, watch, _ = _train(watched=True, closure=True, optimizer=optimizer, plant_at=3, policy="skip")
    bad = [e for e in watch.events if e.kind.startswith("nonfinite")]
    assert [(e.kind, e.step) for e in bad] == [("nonfinite-loss", 3)]
    assert bad[0].origins and bad[0].origins[0].module == "b"
    assert watch.history.skipped_steps == [3]
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_skip_inside_a_closure_leaves_the_weights_of_the_step_before():
    """The update of the bad step never happens: the weights after it are the twin's after step 2
    (the twin runs three steps), not NaN and not moved."""
    twin, _, _ = _train(watched=False, closure=True, steps=3)
    model, _, _ = _train(watched=True, closure=True, steps=4, plant_at=3, policy="skip")
    for mine, theirs in zip(model.parameters(), twin.parameters()):
        assert torch.equal(mine, theirs)


@pytest.mark.parametrize("closure", [True, False], ids=["step(closure)", "backward-then-step"])
def test_a_nan_loss_from_the_data_is_a_nonfinite_loss_not_a_gradient(closure):
    _, watch, _ = _train(watched=True, closure=closure, nan_target_at=2, policy="skip")
    bad = [e for e in watch.events if e.kind.startswith("nonfinite")]
    assert [(e.kind, e.step) for e in bad] == [("nonfinite-loss", 2)]


def test_a_scaled_loss_is_read_unscaled():
    """``scaler.scale(loss).backward()``: the root is loss x scale; the step's loss is the loss."""
    torch.manual_seed(0)
    model = TwoLayers()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    watch = nbguard.watch(model, optimizer=opt, scaler=scaler, log_to=None, verify=False)
    losses = []
    for _ in range(3):
        x, y = torch.randn(4, 8), torch.randn(4, 4)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(float(loss.detach()))
    watch.detach()
    assert watch.history.loss == pytest.approx(losses, rel=1e-6)


def test_a_backward_that_does_not_go_through_the_model_is_not_its_loss():
    torch.manual_seed(0)
    model = TwoLayers()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    other = torch.nn.Linear(3, 1)
    watch = nbguard.watch(model, optimizer=opt, log_to=None, verify=False)
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    opt.zero_grad()
    out = model(x)
    other(torch.randn(2, 3)).sum().mul(1e6).backward()  # someone else's backward, mid-step
    loss = torch.nn.functional.mse_loss(out, y)
    loss.backward()
    opt.step()
    watch.detach()
    assert watch.history.loss == pytest.approx([float(loss.detach())], rel=1e-6)


def test_backward_keeps_its_signature_while_watched_and_is_restored_after():
    original = torch.autograd.backward
    model = TwoLayers()
    watch = nbguard.watch(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), log_to=None, verify=False)
    try:
        assert torch.autograd.backward is not original
        assert inspect.signature(torch.autograd.backward) == inspect.signature(original)
        assert torch.autograd.backward.__name__ == original.__name__
    finally:
        watch.detach()
    assert torch.autograd.backward is original


def test_a_failure_in_the_backward_tap_never_breaks_the_users_backward(monkeypatch):
    from nbguard.watcher.core.steps import WatchSteps

    def broken(self, root):
        raise RuntimeError("planted failure in nbguard's backward tap")

    monkeypatch.setattr(WatchSteps, "_take_backward_root", broken)
    twin, _, truth = _train(watched=False, closure=False, steps=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, watch, seen = _train(watched=True, closure=False, steps=3)
    assert seen == truth
    for mine, theirs in zip(model.parameters(), twin.parameters()):
        assert torch.equal(mine, theirs)


def _recipe(*, watched: bool, policy: str = "warn", blow_up: tuple[int, ...] = (), steps: int = 36,
            read: str = "host", fused: bool | None = None, lr_seen: list | None = None):
    """A torchtune-style recipe loop: logits from the model, cross-entropy computed after it; the LR is
    multiplied by 1000 for the steps in ``blow_up`` (a scheduler gone wrong). Returns per-step losses.
    ``read``, ``fused``: the watch's read mode and the AdamW's (test_deferred_read.py); ``lr_seen`` gets the LR
    each update runs at (after the watch's own pre-step hook)."""
    from nbguard.testing import tiny_llama
    from nbguard.watcher import RewindSettings, WatchSettings

    torch.manual_seed(0)
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=fused)
    watch = nbguard.watch(model, optimizer=opt, policy=policy, log_to=None, verify=False,
                          rewind=RewindSettings(every=5) if policy == "rewind" else None,
                          settings=WatchSettings(read=read)) if watched else None
    if lr_seen is not None:
        opt.register_step_pre_hook(lambda o, args, kwargs: lr_seen.append(o.param_groups[0]["lr"]))
    data = torch.Generator().manual_seed(1)
    zipf = 1.0 / torch.arange(1, model.config.vocab_size + 1, dtype=torch.float64) ** 1.5
    losses = []
    for step in range(steps):
        # fresh tokens each step from a skewed (Zipf) distribution: the loss settles at its entropy, well
        # below a uniform guess, so a run that lost a few steps to a rewind ends where the healthy one does
        ids = torch.multinomial(zipf, 8 * 16, replacement=True, generator=data).view(8, 16)
        if step in blow_up or (blow_up and step == blow_up[-1] + 1):
            for group in opt.param_groups:
                group["lr"] = 3e-3 * (1000.0 if step in blow_up else 1.0)
        logits = model(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    if watch is not None:
        watch.detach()
    return losses, watch


def test_a_blow_up_of_a_loss_computed_outside_the_model_is_a_divergence_and_rewind_rescues_it():
    healthy, _ = _recipe(watched=False)
    blown, _ = _recipe(watched=False, blow_up=(20, 21, 22))
    assert blown[-1] > 5 * healthy[-1]  # the planted fault: the unwatched run never recovers
    _, warned = _recipe(watched=True, blow_up=(20, 21, 22))
    divergence = [e for e in warned.events if e.kind == "divergence"]
    assert divergence and divergence[0].step in (20, 21)
    assert divergence[0].evidence.get("loss") is not None  # judged with the loss, not the gradient norm alone
    rescued, watch = _recipe(watched=True, policy="rewind", blow_up=(20, 21, 22))
    assert any(e.kind == "rewind" for e in watch.events)
    assert rescued[-1] <= 1.25 * healthy[-1], (rescued[-1], healthy[-1])
