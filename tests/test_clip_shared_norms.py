"""Issue 19 item 5 (a): a watched ``clip_grad_norm_`` takes the per-tensor norms once, for the clip and
for the watch. What the user gets back must be torch's own result, bit for bit: the returned total
norm and every clipped gradient, compared with an unwatched copy of the same model on the same batch.
"""
import copy
import math

import pytest
import torch
from watch_helpers import batches

from nbguard.testing import tiny_llama
from nbguard.watcher import NanWatch
from nbguard.watcher.reads import clip_tap
from nbguard.watcher.reads.history import group_name

torch.set_num_threads(1)

_INT = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float64: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits (NaN payloads included): equal bits, identical values."""
    return t.detach().contiguous().view(_INT[t.dtype])


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _group_norms(model) -> dict[str, float]:
    """Per-group 2-norm of the current (pre-clip) gradients, in fp64 from scratch: the reference."""
    squares: dict[str, float] = {}
    for name, p in model.named_parameters():
        if p.requires_grad and p.grad is not None:
            g = group_name(name)
            squares[g] = squares.get(g, 0.0) + float(p.grad.double().square().sum())
    return {g: math.sqrt(v) for g, v in squares.items()}


class _CountNorms:
    """Counts ``torch._foreach_norm`` calls over gradients and the tensors they read (one pass = each once)."""

    def __init__(self, monkeypatch):
        self.calls = self.tensors = 0
        original = torch._foreach_norm

        def counted(tensors, *args, **kwargs):
            # gradients: the weight fingerprint reads weights (Parameters), the update norms the per-group
            # segments of their flat weight buffers (views: a ._base); a gradient is a tensor of its own
            if not isinstance(tensors[0], torch.nn.Parameter) and tensors[0]._base is None:
                self.calls += 1
                self.tensors += len(tensors)
            return original(tensors, *args, **kwargs)

        monkeypatch.setattr(torch, "_foreach_norm", counted)


def _backward(model, batch):
    model(**batch).loss.backward()


def _pair(dtype=torch.float32, setup=None):
    """A model and an unwatched deep copy, both with the same gradients of one batch."""
    model = tiny_llama(dtype=dtype)
    if setup is not None:
        setup(model)
    twin = copy.deepcopy(model)
    batch = batches(1)[0]
    for m in (model, twin):
        _backward(m, batch)
    return model, twin


def _watch(model):
    return NanWatch(model, optimizer=torch.optim.SGD(model.parameters(), lr=1e-3)).attach()


def _assert_clip_identical(model, twin, clip_args=(0.05,), clip_kwargs=None, params=None):
    clip_kwargs = clip_kwargs or {}
    params = params or (lambda m: m.parameters())
    expected_norms = _group_norms(model)
    watch = _watch(model)
    try:
        got = torch.nn.utils.clip_grad_norm_(params(model), *clip_args, **clip_kwargs)
        assert clip_tap.tapped()
        read = watch._collector.read([], None, False).grad_norm  # the step's one read, as the watch makes it
    finally:
        watch.detach()
    want = torch.nn.utils.clip_grad_norm_(params(twin), *clip_args, **clip_kwargs)
    assert not clip_tap.tapped()
    assert _same_bits(got, want), (got, want)
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            assert _same_bits(p.grad, q.grad), name
    # the watch read the gradients before the clip scaled them
    groups = watch._collector.groups
    for g, value in zip(groups, read):
        want_norm = expected_norms.get(g, 0.0)
        assert math.isclose(value, want_norm, rel_tol=1e-5, abs_tol=1e-12) or (math.isnan(value) and math.isnan(want_norm)), g
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shared_clip_is_bit_identical_to_torch(dtype):
    model, twin = _pair(dtype)
    total = _assert_clip_identical(model, twin)
    assert total.dtype == dtype and float(total) > 0.05  # the clip did scale the gradients


def test_fp32_clip_reads_each_gradient_once(monkeypatch):
    model, twin = _pair()
    watch = _watch(model)
    counter = _CountNorms(monkeypatch)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    watch._collector.read([], None, False)  # the step's one read takes nothing more
    watch.detach()
    trainable = sum(1 for p in model.parameters() if p.requires_grad)
    assert (counter.calls, counter.tensors) == (1, trainable)


def test_bf16_gradients_are_read_in_fp32_besides_the_clip(monkeypatch):
    """torch clips bf16 gradients with bf16 norms; the watch keeps its fp32-accumulated ones."""
    model, twin = _pair(torch.bfloat16)
    watch = _watch(model)
    counter = _CountNorms(monkeypatch)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    squares = watch._collector._taken
    watch.detach()
    trainable = sum(1 for p in model.parameters() if p.requires_grad)
    assert (counter.calls, counter.tensors) == (2, 2 * trainable)
    assert squares is not None and [n.dtype for n, _ in squares] == [torch.float32]


def test_mixed_dtypes_keep_torchs_grouping_order():
    def mixed(model):
        model.model.layers[0].mlp.to(torch.bfloat16)
        model.lm_head.to(torch.float64)

    # the bf16 MLP's forward needs bf16 inputs: autocast-free, run the MLP's dtype through a hook
    def setup(model):
        mixed(model)
        for module, dtype in ((model.model.layers[0].mlp, torch.bfloat16), (model.lm_head, torch.float64)):
            module.register_forward_pre_hook(lambda m, args, d=dtype: tuple(a.to(d) for a in args))
            module.register_forward_hook(lambda m, args, out: out.float())

    model, twin = _pair(setup=setup)
    assert {p.grad.dtype for p in model.parameters()} == {torch.float32, torch.bfloat16, torch.float64}
    _assert_clip_identical(model, twin)


@pytest.mark.parametrize("clip_args, clip_kwargs", [
    ((0.05, 1.0), {}),
    ((0.05,), {"norm_type": float("inf")}),
    ((0.05,), {"norm_type": 3}),
    ((0.05,), {"error_if_nonfinite": True}),
    ((0.05,), {"foreach": True}),
    ((0.05,), {"foreach": False}),
    ((), {"max_norm": 0.05, "norm_type": 2}),
    ((0.05, 2.0, False, None), {}),
])
def test_other_arguments_are_torchs_own_path_and_still_read_before_the_clip(clip_args, clip_kwargs):
    model, twin = _pair()
    _assert_clip_identical(model, twin, clip_args, clip_kwargs)


def test_error_if_nonfinite_still_raises_and_nan_norms_stay_identical():
    model, twin = _pair()
    for m in (model, twin):
        m.model.layers[1].mlp.down_proj.weight.grad[0, 0] = float("nan")
    total = _assert_clip_identical(model, twin)
    assert math.isnan(float(total))
    watch = _watch(model)
    try:
        with pytest.raises(RuntimeError, match="non-finite"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05, error_if_nonfinite=True)
    finally:
        watch.detach()


@pytest.mark.parametrize("which", ["subset", "superset", "generator", "one tensor", "frozen"])
def test_clip_over_other_parameters_than_the_watchs(which):
    other = torch.nn.Linear(4, 3)
    other_twin = copy.deepcopy(other)
    x = torch.randn(2, 4)
    for m in (other, other_twin):
        m(x).sum().backward()

    def setup(model):
        if which == "frozen":
            for p in model.model.embed_tokens.parameters():
                p.requires_grad_(False)

    model, twin = _pair(setup=setup)
    params = {
        "subset": lambda m: list(m.model.layers[1].parameters()),
        "superset": lambda m: list(m.parameters()) + list((other if m is model else other_twin).parameters()),
        "generator": lambda m: (p for p in m.parameters()),
        "one tensor": lambda m: m.lm_head.weight,
        "frozen": lambda m: m.parameters(),
    }[which]
    _assert_clip_identical(model, twin, params=params)
    if which == "superset":
        assert _same_bits(other.weight.grad, other_twin.weight.grad)


def test_a_second_clip_in_the_step_is_torchs_own(monkeypatch):
    model, twin = _pair()
    watch = _watch(model)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    counter = _CountNorms(monkeypatch)
    got = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
    calls = counter.calls
    watch.detach()
    torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.05)
    want = torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.01)
    assert _same_bits(got, want) and calls == 1  # torch's pass only: the watch read at the first clip


def test_training_steps_match_an_unwatched_run_bit_for_bit():
    """Four AdamW steps, each clipping: the watched weights stay the unwatched ones, norms as the hooks give."""
    model = tiny_llama()
    twin = copy.deepcopy(model)
    runs = []
    for m, watched in ((model, True), (twin, False)):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        watch = _watch_with(m, opt) if watched else None
        norms = []
        for batch in batches(4):
            m(**batch).loss.backward()
            norms.append(torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5))
            opt.step()
            opt.zero_grad()
        if watch is not None:
            watch.detach()
            assert watch.step == 4 and watch.events == []
            # the watch's total (pre-clip) norm is the clip's own
            assert all(math.isclose(watch.history.total_grad_norm[s], float(norms[s]), rel_tol=1e-5) for s in range(4))
        runs.append((norms, [p.detach().clone() for p in m.parameters()]))
    (norms, weights), (twin_norms, twin_weights) = runs
    assert all(_same_bits(a, b) for a, b in zip(norms, twin_norms, strict=True))
    assert all(_same_bits(a, b) for a, b in zip(weights, twin_weights, strict=True))


def _watch_with(target, opt):
    return NanWatch(target, optimizer=opt).attach()


def test_torchs_own_clip_is_what_the_tap_shares():
    """Only torch's clip_grad_norm_ is re-derived; a function another library put there is called as is."""
    calls = []

    def library_clip(parameters, max_norm, *args, **kwargs):
        calls.append(max_norm)
        return torch.tensor(0.0)

    original = torch.nn.utils.clip_grad_norm_
    torch.nn.utils.clip_grad_norm_ = library_clip
    try:
        model, _ = _pair()
        watch = _watch(model)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        taken = watch._collector._taken is not None  # the watch still read before the library's clip
        watch.detach()
        assert calls == [0.05] and taken
    finally:
        torch.nn.utils.clip_grad_norm_ = original


def logged_grad_norms(trainer) -> list[float]:
    """The grad_norm the Trainer logged at each step (logging_steps=1)."""
    return [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry]


def _trainer_run(watched: bool, monkeypatch):
    import tempfile

    from transformers import Trainer, TrainingArguments

    from nbguard.testing import TinyDataset

    model = tiny_llama()
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), max_steps=3, per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, max_grad_norm=0.05, use_cpu=True, report_to=[],
                             save_strategy="no", logging_steps=1, disable_tqdm=True, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=TinyDataset(16))
    watch = _watch_with(trainer, None) if watched else None
    counter = _CountNorms(monkeypatch)
    trainer.train()
    if watch is not None:
        watch.detach()
        assert watch.step == 3 and [e.kind for e in watch.events] == []
    monkeypatch.undo()
    return logged_grad_norms(trainer), [p.detach().clone() for p in model.parameters()], counter.calls, watch


def test_trainer_clip_through_accelerate_is_shared_and_bit_identical(monkeypatch):
    norms, weights, calls, watch = _trainer_run(True, monkeypatch)
    twin_norms, twin_weights, twin_calls, _ = _trainer_run(False, monkeypatch)
    assert len(norms) == 3 and norms == twin_norms  # the grad_norm the Trainer logs, to the last bit
    assert all(_same_bits(a, b) for a, b in zip(weights, twin_weights, strict=True))
    assert calls == twin_calls  # the watch read no gradient a second time
    # and its per-group norms are the pre-clip ones the Trainer's clip saw
    assert all(math.isclose(watch.history.total_grad_norm[s], norms[s], rel_tol=1e-5) for s in range(3))


def test_a_failure_before_the_clip_falls_back_to_torchs_own_call(monkeypatch):
    def broken(parameters):
        raise RuntimeError("not this time")

    monkeypatch.setattr(clip_tap, "_clip_norms", broken)
    model, twin = _pair()
    _assert_clip_identical(model, twin)  # the watch read first, then torch's own clip ran


def test_the_total_norm_follows_a_new_list_of_group_norms():
    from nbguard.watcher.reads.sentinel import StepStats

    stats = StepStats([3.0, 4.0], None, None, None)
    assert stats.total_grad_norm == 5.0
    stats.grad_norm = [6.0, 8.0]  # what settle() does across ranks (sharded: whole-gradient norms)
    assert stats.total_grad_norm == 10.0


def test_a_step_with_nothing_to_read_gives_zero_norms():
    """No gradient read (paused), no loss, no detector scalars: zeros, as before, without a read."""
    model = tiny_llama()
    watch = _watch(model)
    watch._collector.enabled = False
    stats = watch._collector.read([], None, False)
    watch.detach()
    assert stats.grad_norm == [0.0] * len(watch._collector.groups) and stats.loss is None


def _scaled_loop(model, watched: bool, monkeypatch):
    """fp16-style loop on CPU: GradScaler, unscale_, clip to 0.05, step; 3 steps. Returns the clip's
    total norms, the norm passes over gradients counted, and the watch."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    watch = NanWatch(model, optimizer=opt, scaler=scaler).attach() if watched else None
    counter = _CountNorms(monkeypatch)
    totals = []
    for batch in batches(3):
        scaler.scale(model(**batch).loss).backward()
        scaler.unscale_(opt)
        totals.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05))
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    monkeypatch.undo()
    if watch is not None:
        watch.detach()
    return totals, counter.calls, watch


def test_under_a_gradscaler_the_clip_after_unscale_is_the_watchs_only_norm_pass(monkeypatch):
    """The Trainer's fp16 path (unscale_, then clip): the watch takes the clip's norms of the unscaled
    gradients instead of a pass of its own before unscale_; the run is bit-identical to an unwatched one."""
    model = tiny_llama()
    twin = copy.deepcopy(model)
    totals, calls, watch = _scaled_loop(model, True, monkeypatch)
    twin_totals, twin_calls, _ = _scaled_loop(twin, False, monkeypatch)
    assert calls == twin_calls == 3  # one norm pass a step, the clip's, watched or not
    assert all(_same_bits(a, b) for a, b in zip(totals, twin_totals, strict=True))
    assert all(_same_bits(p, q) for p, q in zip(model.parameters(), twin.parameters(), strict=True))
    # what the watch recorded: the clip's pre-clip total (unscaled: not 1024 times it), at the scale used
    assert watch.history.loss_scale == [1024.0] * 3
    for step, total in enumerate(totals):
        assert math.isclose(watch.history.total_grad_norm[step], float(total), rel_tol=1e-5)


def test_a_value_clip_is_read_before_its_clamp_hides_an_inf():
    model, _ = _pair()
    with torch.no_grad():
        model.lm_head.weight.grad[0, 0] = float("inf")
    watch = _watch(model)
    torch.nn.utils.clip_grad_value_(model.parameters(), 0.01)  # the inf becomes 0.01
    read = dict(zip(watch._collector.groups, watch._collector.read([], None, False).grad_norm))
    watch.detach()
    assert torch.isfinite(model.lm_head.weight.grad).all()
    assert math.isinf(read["lm_head"]) and math.isfinite(read["model.norm"])
