"""``nbguard.lightning_callback()`` on a real ``lightning.Trainer`` (tiny torch model, tiny local data, CPU):
automatic optimization (``optimizer.step(closure)``) and manual optimization, the loss computed in
``training_step`` after the model. Every claim is checked against an unwatched twin run of the same seed,
or against the step and module where the fault was planted."""
from __future__ import annotations

import math
import warnings

import pytest
import torch

import nbguard
from nbguard.watcher import RewindSettings

lightning = pytest.importorskip("lightning")
torch.set_num_threads(1)

STEPS = 40


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 32)
        self.b = torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


class Regression(lightning.LightningModule):
    """Learns a fixed linear map; ``plant_at`` makes ``net.b``'s output NaN at that optimizer step;
    ``spike`` puts the LR at that value for optimizer steps 20-22 (a bad schedule)."""

    def __init__(self, *, manual=False, calls_self=True, plant_at=None, spike=None, lr=0.05):
        super().__init__()
        self.net = Net()
        self.automatic_optimization = not manual
        self.calls_self, self.plant_at, self.spike, self.lr = calls_self, plant_at, spike, lr
        self.losses: list[float] = []  # what each optimizer step trained on (the mean over its micro-batches)
        self._hook = None

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x) if self.calls_self else self.net(x), y)
        self.losses.append(float(loss.detach()))
        if not self.automatic_optimization:
            opt, sched = self.optimizers(), self.lr_schedulers()
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
            sched.step()
        return loss

    def on_train_batch_start(self, batch, batch_idx):
        if self.trainer.global_step == self.plant_at:
            self._hook = self.net.b.register_forward_hook(lambda m, args, out: out * float("nan"))
        if self.spike is not None and 20 <= self.trainer.global_step < 23:
            for group in self.trainer.optimizers[0].param_groups:
                group["lr"] = self.spike  # the scheduler's next step puts it back

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.98 ** (step // 5))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def _data(rows=120):  # 30 batches: whole accumulation windows of 3 in every epoch
    g = torch.Generator().manual_seed(1)
    x = torch.randn(rows, 8, generator=g)
    y = x @ torch.randn(8, 4, generator=g) + 0.05 * torch.randn(rows, 4, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4, shuffle=False)


def _fit(callback=None, accumulate=1, trainer_options=None, **module_options):
    torch.manual_seed(0)
    module = Regression(**module_options)
    options = {"logger": False, **(trainer_options or {})}
    trainer = lightning.Trainer(max_steps=STEPS, accelerator="cpu", devices=1, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False,
                                accumulate_grad_batches=accumulate, callbacks=[callback] if callback else [],
                                **options)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(num_workers|does not have many workers).*")
        trainer.fit(module, _data())
    return module, trainer


def _weights(module):
    return [p.detach().clone() for p in module.parameters()]


def _scheduler(trainer):
    return trainer.lr_scheduler_configs[0].scheduler


@pytest.mark.parametrize(("manual", "accumulate"), [(False, 1), (False, 3), (True, 1)],
                         ids=["automatic", "automatic-accumulate-3", "manual"])  # accumulation is automatic's
def test_a_healthy_fit_is_bit_identical_to_an_unwatched_one_and_quiet(manual, accumulate):
    twin, twin_trainer = _fit(manual=manual, accumulate=accumulate)
    cb = nbguard.lightning_callback(log_to=None, verify=False)
    module, trainer = _fit(cb, manual=manual, accumulate=accumulate)
    assert all(torch.equal(a, b) for a, b in zip(_weights(module), _weights(twin)))
    assert module.losses == twin.losses
    assert cb.watch.events == []
    # Lightning's own step counter, scheduler and accumulation are left as they were
    assert trainer.global_step == twin_trainer.global_step == STEPS
    assert _scheduler(trainer).state_dict() == _scheduler(twin_trainer).state_dict()
    # one watched step per optimizer step, each with the loss it trained on (the mean of its micro-batches)
    assert len(cb.watch.history.loss) == STEPS
    per_step = [sum(module.losses[i:i + accumulate]) / accumulate for i in range(0, STEPS * accumulate, accumulate)]
    assert cb.watch.history.loss == pytest.approx(per_step, rel=1e-5)
    assert not cb.watch.attached  # detached when fit ended


def test_clipping_and_bf16_mixed_are_left_as_they_were():
    options = {"gradient_clip_val": 0.5, "precision": "bf16-mixed"}
    twin, _ = _fit(trainer_options=options, accumulate=2)
    cb = nbguard.lightning_callback(log_to=None, verify=False)
    module, trainer = _fit(cb, trainer_options=options, accumulate=2)
    assert all(torch.equal(a, b) for a, b in zip(_weights(module), _weights(twin)))
    assert cb.watch.events == [] and len(cb.watch.history.loss) == trainer.global_step == STEPS


def test_16_mixed_is_watched_through_lightnings_own_grad_scaler():
    """fp16 autocast with a GradScaler (on the CPU through Lightning's MixedPrecision plugin, as 16-mixed does on a
    GPU): the scaler skips non-finite steps itself; the watch reads it, changes nothing, and names the module."""
    from lightning.pytorch.plugins import MixedPrecision

    def options():
        return {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]}

    twin, _ = _fit(trainer_options=options())
    cb = nbguard.lightning_callback(log_to=None, verify=False)
    module, trainer = _fit(cb, trainer_options=options())
    assert all(torch.equal(a, b) for a, b in zip(_weights(module), _weights(twin)))
    assert cb.watch.scaler is trainer.precision_plugin.scaler
    assert cb.watch.history.loss[:5] == pytest.approx(module.losses[:5], rel=1e-6)  # read unscaled
    cb = nbguard.lightning_callback(policy="skip", log_to=None, verify=False)
    module, _ = _fit(cb, trainer_options=options(), plant_at=12)
    planted = [e for e in cb.watch.events if e.step == 12]
    assert [(e.kind, e.origins[0].module) for e in planted] == [("scaler-skip", "net.b")]
    assert all(torch.isfinite(p).all() for p in module.parameters())


@pytest.mark.parametrize("manual", [False, True], ids=["automatic", "manual"])
def test_a_nan_planted_at_a_step_is_caught_at_that_step_in_that_module_and_skip_keeps_the_weights_finite(manual):
    cb = nbguard.lightning_callback(policy="skip", log_to=None, verify=False)
    module, trainer = _fit(cb, manual=manual, plant_at=12)
    bad = [e for e in cb.watch.events if e.kind.startswith("nonfinite")]
    assert [(e.kind, e.step) for e in bad] == [("nonfinite-loss", 12)]
    assert bad[0].origins[0].module == "net.b"
    assert cb.watch.history.skipped_steps == [12]
    assert all(torch.isfinite(p).all() for p in module.parameters())
    assert trainer.global_step == STEPS


def test_without_the_watch_the_planted_nan_ruins_the_run():
    module, _ = _fit(plant_at=12)  # the ground truth the skip test is measured against
    assert not all(torch.isfinite(p).all() for p in module.parameters())


def test_an_lr_blow_up_is_caught_as_divergence_and_rewind_brings_the_run_back():
    healthy, _ = _fit()
    ruined, _ = _fit(spike=3.0)
    cb = nbguard.lightning_callback(policy="rewind", rewind=RewindSettings(every=5), log_to=None, verify=False)
    rewound, trainer = _fit(cb, spike=3.0)
    final = lambda m: sum(m.losses[-5:]) / 5  # noqa: E731
    assert not math.isfinite(final(ruined)) or final(ruined) > 1.25 * final(healthy)
    assert math.isfinite(final(rewound)) and abs(final(rewound) - final(healthy)) <= 0.25 * final(healthy)
    kinds = [e.kind for e in cb.watch.events]
    assert "divergence" in kinds
    rewinds = [e for e in cb.watch.events if e.kind == "rewind"]
    assert rewinds and rewinds[0].evidence["restored_after_step"] <= 19
    assert trainer.global_step == STEPS  # Lightning's counter moves on: the batches in between were dropped


def test_a_training_step_that_calls_a_submodule_is_watched_through_module():
    cb = nbguard.lightning_callback(module="net", policy="skip", log_to=None, verify=False)
    module, _ = _fit(cb, calls_self=False, plant_at=7)
    bad = [e for e in cb.watch.events if e.kind.startswith("nonfinite")]
    assert [(e.kind, e.step, e.origins[0].module) for e in bad] == [("nonfinite-loss", 7, "b")]
    assert all(torch.isfinite(p).all() for p in module.parameters())


def test_a_root_that_training_step_never_calls_is_said_after_the_first_step():
    cb = nbguard.lightning_callback(log_to=None, verify=False)
    with pytest.warns(RuntimeWarning, match="training_step did not call the LightningModule itself"):
        _fit(cb, calls_self=False)


def test_log_to_lightning_sends_the_events_to_the_trainers_tensorboard_logger(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    logger = lightning.pytorch.loggers.TensorBoardLogger(str(tmp_path), name="run")
    cb = nbguard.lightning_callback(policy="skip", log_to="lightning", verify=False)
    _fit(cb, plant_at=12, trainer_options={"logger": logger})
    events = EventAccumulator(logger.log_dir, size_guidance={"tensors": 0})
    events.Reload()
    texts = [(t.step, tensor_util.make_ndarray(t.tensor_proto).item().decode())
             for t in events.Tensors("nbguard/events/text_summary")]
    assert [step for step, _ in texts] == [12] and texts[0][1].startswith("**nonfinite-loss** at step 12")
    assert "nbguard/total_grad_norm" in events.Tags()["scalars"]


def test_log_to_lightning_without_a_tracker_says_so_and_still_watches(tmp_path):
    logger = lightning.pytorch.loggers.CSVLogger(str(tmp_path))
    cb = nbguard.lightning_callback(policy="skip", log_to="lightning", verify=False)
    with pytest.warns(RuntimeWarning, match="log_to='lightning' found no tracker"):
        _fit(cb, plant_at=3, trainer_options={"logger": logger})
    assert [(e.kind, e.step) for e in cb.watch.events] == [("nonfinite-loss", 3)]


def test_the_callback_refuses_what_it_sets_itself():
    with pytest.raises(TypeError, match="sets optimizer"):
        nbguard.lightning_callback(optimizer=torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1))
    with pytest.raises(ValueError, match="policy='bogus'"):
        nbguard.lightning_callback(policy="bogus")


# ---- Fabric: the user's own loop; the watch goes on the module and optimizer Fabric set up --------------------
def _fabric_run(watched, plant_at=None, policy="warn", steps=12, spike=None, lr=1e-2, **watch_options):
    """``spike``: a LambdaLR schedule puts the LR at that value for steps 20-22 (a bad schedule), then back."""
    from lightning.fabric import Fabric

    torch.manual_seed(0)
    fabric = Fabric(accelerator="cpu", devices=1)
    net = Net()
    raw = torch.optim.AdamW(net.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(raw, lambda s: spike / lr if spike and 20 <= s < 23 else 1.0)
    model, optimizer = fabric.setup(net, raw)
    loader = fabric.setup_dataloaders(_data(), move_to_device=True)
    watch = nbguard.watch(net, optimizer=optimizer, scheduler=scheduler, policy=policy, log_to=None, verify=False,
                          **watch_options) if watched else None
    losses = []
    batches = (batch for _ in range(steps) for batch in loader)  # epoch after epoch
    for step, (x, y) in zip(range(steps), batches):
        hook = net.b.register_forward_hook(lambda m, a, out: out * float("nan")) if step == plant_at else None
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)  # computed outside the model, as Fabric loops do
        fabric.backward(loss)
        optimizer.step()
        scheduler.step()
        losses.append(float(loss.detach()))
        if hook is not None:
            hook.remove()
    if watch is not None:
        watch.detach()
    return net, watch, losses


def test_fabric_healthy_loop_is_bit_identical_and_quiet():
    twin, _, twin_losses = _fabric_run(watched=False)
    net, watch, losses = _fabric_run(watched=True)
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), twin.parameters())) and losses == twin_losses
    assert watch.events == [] and watch.history.loss == pytest.approx(losses, rel=1e-6)


def test_fabric_nan_is_caught_at_its_step_in_its_module_and_skipped():
    net, watch, _ = _fabric_run(watched=True, plant_at=4, policy="skip")
    bad = [e for e in watch.events if e.kind.startswith("nonfinite")]
    assert [(e.kind, e.step, e.origins[0].module) for e in bad] == [("nonfinite-loss", 4, "b")]
    assert all(torch.isfinite(p).all() for p in net.parameters())


def test_fabric_lr_blow_up_is_caught_as_divergence_and_rewind_brings_the_loop_back():
    # three epochs, each loss the mean of the last one (this data's batches differ in loss by up to 5x); AdamW at 3e-2:
    # after the spike's two rewinds the LR is a quarter of it, and at a quarter of 1e-2 the loop has not
    # converged by the end (rewound 3.86 vs healthy 0.47)
    steps, final = 90, lambda losses: sum(losses[-30:]) / 30  # noqa: E731
    _, _, healthy = _fabric_run(watched=False, steps=steps, lr=3e-2)
    _, _, ruined = _fabric_run(watched=False, steps=steps, lr=3e-2, spike=3.0)
    net, watch, rewound = _fabric_run(watched=True, steps=steps, lr=3e-2, spike=3.0, policy="rewind",
                                      rewind=RewindSettings(every=5))
    assert not math.isfinite(final(ruined)) or final(ruined) > 1.25 * final(healthy)
    assert math.isfinite(final(rewound)) and abs(final(rewound) - final(healthy)) <= 0.25 * final(healthy)
    assert all(torch.isfinite(p).all() for p in net.parameters())
    diverged = [e.step for e in watch.events if e.kind == "divergence"]
    assert diverged and 20 <= diverged[0] <= 23 and not [e for e in watch.events if e.step < 20]
    rewinds = [e for e in watch.events if e.kind == "rewind"]
    assert rewinds and all(e.evidence["restored"] and e.evidence["restored_after_step"] <= 19 for e in rewinds)
    assert len(rewound) == steps  # the loop's own count moves on: the batches in between were dropped
