"""On a real CUDA GPU: what the CPU suite cannot show. Skipped where torch sees no CUDA device (CI);
run on a GPU machine with ``python -m pytest -m cuda tests/test_cuda.py tests/test_watch_scaler.py`` (or ``bash benchmarks/on_gpu.sh``).

- fp16 overflowing in CUDA's kernels (and, in tests/test_watch_scaler.py's cuda case, CUDA's autocast
  and GradScaler skipping every step: its inf check is CUDA's own);
- a Trainer with ``fp16=True``: accelerate refuses fp16 autocast on CPU, so only a GPU runs the
  Trainer's real GradScaler path (unscale, then the clip the watch shares);
- the clip's multi-tensor norm kernels, bit for bit against torch's own clip;
- the detected hardware, and a fix verified on the failing step under CUDA autocast.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
from audit_helpers import make_args, make_trainer
from test_clip_shared_norms import _assert_clip_identical, _same_bits, logged_grad_norms
from watch_helpers import batches, identical, scale_output_to, snapshot

import nbguard
from nbguard.hardware import detect
from nbguard.testing import TinyDataset, plant_fp16_overflow_token, tiny_batch, tiny_llama
from nbguard.watcher import NanWatch, WatchSettings

pytestmark = pytest.mark.cuda
CUDA = torch.device("cuda")


def _on_gpu(batch: dict) -> dict:
    return {k: v.to(CUDA) for k, v in batch.items()}


def test_detect_reads_this_gpu_and_its_native_bf16():
    hw = detect()
    props = torch.cuda.get_device_properties(0)
    assert hw.device_type == "cuda" and hw.detected and hw.display_name == props.name
    assert hw.compute_capability == (props.major, props.minor)
    assert hw.native_bf16 is (props.major >= 8)
    assert hw.native_bf16 is torch.cuda.is_bf16_supported(including_emulation=False)
    for hint, name in (("H100", "h100"), ("H200", "h200"), ("A100", "a100"), ("T4", "t4")):
        if hint in props.name:
            assert hw.name == name
    assert hw.memory_gb == round(props.total_memory / 2**30, 1)


def test_cuda_fp16_weights_overflow_is_named_in_the_step_it_happens():
    """fp16 weights, no scaler: q_proj's fp16 output passes 65504 on one token, the loss turns NaN,
    and the watch names q_proj in that step (the replay runs under CUDA too)."""
    model = tiny_llama()
    plant_fp16_overflow_token(model, 7)
    model = model.to(CUDA, torch.float16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    clean = _on_gpu(batches(1, avoid=7)[0])
    hot = _on_gpu(batches(1, avoid=7, seed=5)[0])
    hot["input_ids"][0, 3] = 7
    with NanWatch(model, optimizer=opt) as watch:
        for batch in (clean, clean, hot):
            model(**batch).loss.backward()
            opt.step()
            opt.zero_grad()
    assert [e.step for e in watch.events if e.kind.startswith("nonfinite")][:1] == [2], watch.summary()
    first = next(e for e in watch.events if e.kind.startswith("nonfinite"))
    assert first.origin("forward").module == "model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_shared_clip_on_cuda_is_bit_identical_to_torch(dtype):
    model = tiny_llama(dtype=dtype).to(CUDA)
    twin = copy.deepcopy(model)
    batch = _on_gpu(batches(1)[0])
    for m in (model, twin):
        m(**batch).loss.backward()
    total = _assert_clip_identical(model, twin)
    assert total.device.type == "cuda" and float(total) > 0.05


def _trainer_fp16(watched: bool, tmp_path, plant: bool = False):
    model = tiny_llama()
    if plant:
        data = TinyDataset(16)
        first = {k: torch.stack([data[i][k] for i in range(2)]) for k in data[0]}
        scale_output_to(model, model.model.layers[0].mlp.up_proj, first, 2e5)
    args = make_args(tmp_path, use_cpu=False, fp16=True, max_steps=10 if plant else 4, per_device_train_batch_size=2,
                     gradient_accumulation_steps=2, max_grad_norm=0.05, seed=0, eval_strategy="no")
    trainer = make_trainer(model, args, rows=16)
    watch = NanWatch(trainer).attach() if watched else None
    trainer.train()
    if watch is not None:
        watch.detach()
    return trainer, watch


def test_fp16_trainer_on_cuda_shares_the_clip_after_unscale_bit_for_bit(tmp_path):
    """The Trainer's real fp16 path (accelerate's GradScaler, unscale, then the clip): the watched run
    logs the same grad_norm and ends with the same weights as an unwatched one, to the last bit."""
    trainer, watch = _trainer_fp16(True, tmp_path / "a")
    twin, _ = _trainer_fp16(False, tmp_path / "b")
    logged = logged_grad_norms(trainer)
    assert trainer.accelerator.scaler is not None  # really the fp16 GradScaler path
    assert len(logged) == 4 and logged == logged_grad_norms(twin)
    for p, q in zip(trainer.model.parameters(), twin.model.parameters(), strict=True):
        assert _same_bits(p, q)
    assert watch.events == [], watch.summary()
    for step, norm in enumerate(logged):  # the watch's pre-clip, unscaled norm is the logged one
        assert math.isclose(watch.history.total_grad_norm[step], norm, rel_tol=1e-5)
    assert watch.history.loss_scale[0] == 65536.0


def test_fp16_trainer_on_cuda_skipping_every_step_is_named(tmp_path):
    _, watch = _trainer_fp16(True, tmp_path, plant=True)
    assert watch.history.skipped_steps == list(range(10)), watch.summary()
    skips = [e for e in watch.events if e.kind == "skipped-steps"]
    assert len(skips) == 1 and skips[0].cause == "overflow"
    assert skips[0].origin("forward").module == "model.layers.0.mlp.up_proj"


def test_switch_to_bf16_is_verified_under_cuda_autocast(tmp_path):
    """A model whose q_proj passes 65504 on one token, trained with fp16=True on this GPU: the audit
    (hardware detected, probe on) offers the switch to bf16, and the verdict ran the failing step in
    CUDA's fp16 autocast, then in its bf16 one."""
    model = tiny_llama()
    plant_fp16_overflow_token(model, 7)
    model = model.to(CUDA)
    batch = tiny_batch(2, 12, model.config.vocab_size, seed=3)
    batch["input_ids"][0, 4] = 7
    args = make_args(tmp_path, use_cpu=False, fp16=True)
    result = nbguard.audit(model=model, args=args, batch=_on_gpu(batch), probe=True, verify=True)
    assert result.hardware.device_type == "cuda" and result.hardware.detected
    finding = next(f for f in result.findings if f.rule == "fp16-overflow-risk")
    assert finding.evidence["target_precision"] == ("bf16" if result.hardware.native_bf16 else "fp32")
    verification = result.verification
    assert verification.baseline is not None and not verification.baseline.healthy
    assert verification.baseline.precision.startswith("autocast cuda float16")
    switch = verification.verdict("switch-precision")
    assert switch.verdict == "verified", switch.reason
    assert switch.step.precision.startswith("autocast cuda bfloat16") and "args.bf16 = True" in switch.code


def test_read_deferred_makes_no_host_sync_in_a_healthy_step():
    """Issue 45: with read="deferred" and a fused AdamW under skip, nbguard's step code synchronizes nothing:
    torch.cuda.set_sync_debug_mode("error") raises on any synchronizing call in the steps after the first (the
    first allocates the pinned buffer); the steps' own losses are not read (the loop reads nothing either)."""
    torch.manual_seed(0)
    model = tiny_llama().to(CUDA)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    watch = nbguard.watch(model, optimizer=opt, policy="skip", log_to=None, verify=False,
                          settings=WatchSettings(read="deferred"))
    batches = [_on_gpu(tiny_batch(seed=s)) for s in range(6)]

    def step(batch):
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step(batches[0])
    step(batches[1])
    torch.cuda.synchronize()  # the judged steps' copies have landed: what follows must not wait
    torch.cuda.set_sync_debug_mode("error")
    try:
        for batch in batches[2:]:
            step(batch)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    watch.detach()
    assert watch.events == [] and watch.step == 6 and all(map(math.isfinite, watch.history.loss))


def _reduce_overhead_run(read: str | None, steps: int = 5):
    """``torch.compile(mode="reduce-overhead")``: the compiled forward and backward replay as CUDA graphs; the
    watch (on the module torch.compile returns) runs at the optimizer's step, outside them. ``read`` None: no watch."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = tiny_llama().to(CUDA)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    compiled = torch.compile(model, mode="reduce-overhead")
    watch = None if read is None else nbguard.watch(compiled, optimizer=opt, policy="skip", log_to=None,
                                                    verify=False, settings=WatchSettings(read=read))
    losses = []
    for step in range(steps):
        loss = compiled(**_on_gpu(tiny_batch(seed=step))).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach().clone())  # (a CUDA graph's output is overwritten by its next replay)
    if watch is not None:
        watch.detach()
    return watch, losses, dict(counters["graph_break"]), model


@pytest.mark.parametrize("read", ["host", "deferred"])
def test_reduce_overhead_cuda_graphs_get_no_graph_break_from_the_watch_and_train_as_their_twin(read):
    """Issue 45 item 5 on a GPU: the watch adds no graph break to a ``reduce-overhead`` compile, judges every
    step, and leaves training as it was (the same losses and weights as the unwatched compiled twin)."""
    _, twin_losses, twin_breaks, twin = _reduce_overhead_run(None)
    watch, losses, breaks, model = _reduce_overhead_run(read)
    assert breaks == twin_breaks
    assert watch.events == [] and watch.step == len(losses)
    assert watch.history.loss == [loss.item() for loss in losses]
    assert all(torch.equal(a, b) for a, b in zip(losses, twin_losses))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))
