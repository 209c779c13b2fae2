"""GradScaler runs: a skip streak is an event, a few skips at the start are not; healthy runs are quiet."""
import pytest
import torch
from watch_helpers import batches, identical, scale_output_to, snapshot, train

import nbguard
from nbguard.testing import tiny_llama
from nbguard.watcher import NanWatch, WatchSettings

torch.set_num_threads(1)


def _eval_loss(model, batch):  # in fp32: the eval a user reads stays finite while training is stuck
    model.eval()
    with torch.no_grad():
        loss = model(**batch).loss.item()
    model.train()
    return loss


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("fused", [False, True])
def test_scaler_skipping_every_step_is_the_constant_eval_loss_case(fused, device):
    """On CUDA the autocast kernels, the GradScaler's inf check and the fused AdamW are CUDA's own."""
    model = tiny_llama().to(device)
    data = [{k: v.to(device) for k, v in b.items()} for b in batches(10)]
    scale_output_to(model, model.model.layers[0].mlp.up_proj, data[0], 2e5)
    # a fused AdamW is always called by scaler.step and skips inside its kernel
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
    scaler = torch.amp.GradScaler(device)
    before = snapshot(model)
    eval_losses = []
    settings = WatchSettings(frozen_check_every=2, frozen_after=4)
    with NanWatch(model, optimizer=opt, scaler=scaler, settings=settings) as watch:
        for epoch in range(2):
            train(model, opt, data[epoch * 5:(epoch + 1) * 5], scaler=scaler, autocast=torch.float16)
            eval_losses.append(_eval_loss(model, data[0]))
    assert watch.step == 10 and watch.history.skipped_steps == list(range(10))
    assert identical(before, snapshot(model))  # not a single weight moved
    assert eval_losses[0] == eval_losses[1]  # the seed symptom: eval loss exactly constant
    skips = [e for e in watch.events if e.kind == "skipped-steps"]
    assert len(skips) == 1, watch.summary()
    event = skips[0]
    assert event.step == 7 and event.evidence["consecutive_skipped"] == 8
    trend = event.evidence["scale_trend"]
    assert trend[:3] == [65536.0, 32768.0, 16384.0] and trend == sorted(trend, reverse=True)
    assert event.cause == "overflow"
    assert event.origin("forward").module == "model.layers.0.mlp.up_proj"
    assert any(e.kind == "frozen-params" for e in watch.events)
    assert not any(e.kind in ("nonfinite-loss", "nonfinite-grad") for e in watch.events)


def test_scaler_stop_policy_raises_after_the_streak():
    model = tiny_llama()
    data = batches(10)
    scale_output_to(model, model.model.layers[0].mlp.up_proj, data[0], 2e5)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with nbguard.watch(model, optimizer=opt, scaler=scaler, policy="stop") as watch:
        with pytest.raises(nbguard.NonFiniteError) as info:
            train(model, opt, data, scaler=scaler, autocast=torch.float16)
    assert info.value.event.kind == "skipped-steps" and watch.step == 8


def test_fresh_scaler_skipping_its_first_steps_is_not_an_alarm():
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 22)
    with nbguard.watch(model, optimizer=opt, scaler=scaler) as watch:
        train(model, opt, batches(10), scaler=scaler, autocast=torch.float16)
    skipped = watch.history.skipped_steps
    assert 1 <= len(skipped) < 8 and skipped == list(range(len(skipped)))  # by design, at the start
    # each skipped step is recorded (issue 12), but no streak alarm and nothing else
    assert [e.kind for e in watch.events] == ["scaler-skip"] * len(skipped)
    assert [e.step for e in watch.events] == skipped
    assert watch.history.loss_scale[0] == 2.0 ** 22 and watch.history.loss_scale[-1] < 2.0 ** 22
    norms = watch.history.total_grad_norm
    assert all(n < 1e3 for n in norms[len(skipped):])  # reported unscaled


@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
def test_healthy_runs_raise_no_alarm(autocast):
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with nbguard.watch(model, optimizer=opt) as watch:
        train(model, opt, batches(6), autocast=autocast)
    assert watch.events == [] and watch.step == 6 and watch.history.skipped_steps == []
    assert all(v is not None and v > 0 for v in watch.history.total_grad_norm)
