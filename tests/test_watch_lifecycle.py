"""Attach/detach hygiene, self-removal on internal errors, listeners, the one-read-per-step budget."""
import gc
import json
import weakref

import pytest
import torch
from watch_helpers import batches, hook_counts, train

import nbguard
from nbguard.findings import Event
from nbguard.testing import tiny_llama
from nbguard.watcher import NanWatch

torch.set_num_threads(1)


def _setup():
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    return model, opt, scaler


@pytest.mark.parametrize("activations", [False, True])
def test_detach_restores_every_hook_count_and_attach_never_stacks(activations):
    model, opt, scaler = _setup()
    before = hook_counts(model, opt, scaler)
    watch = nbguard.watch(model, optimizer=opt, scaler=scaler, activations=activations)
    once = hook_counts(model, opt, scaler)
    assert once != before
    assert watch.attach() is watch and hook_counts(model, opt, scaler) == once
    second = nbguard.watch(model, optimizer=opt, scaler=scaler, activations=activations)  # replaces the first
    assert not watch.attached and second.attached and hook_counts(model, opt, scaler) == once
    train(model, opt, batches(2), scaler=scaler, autocast=torch.float16)
    second.detach()
    assert hook_counts(model, opt, scaler) == before
    assert "update" not in vars(scaler)
    second.detach()  # idempotent
    assert hook_counts(model, opt, scaler) == before


def test_context_manager_and_replay_leave_no_hooks_behind():
    model, opt, _ = _setup()
    before = hook_counts(model, opt)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[0, 0] = float("nan")
    with NanWatch(model, optimizer=opt) as watch:
        assert watch.attached
        train(model, opt, batches(1))
    assert not watch.attached and watch.events[0].origin("forward").module == "model.layers.0.mlp.down_proj"
    assert hook_counts(model, opt) == before


def test_an_internal_error_is_recorded_and_the_watches_aside():
    model, opt, _ = _setup()
    before = hook_counts(model, opt)
    watch = nbguard.watch(model, optimizer=opt)

    def broken(*args, **kwargs):
        raise RuntimeError("boom inside nbguard")

    watch._collector.gather = broken  # (the step's read stacks its numbers there, in either read mode)
    with pytest.warns(RuntimeWarning, match="detached after an internal error"):
        train(model, opt, batches(3))  # the user's loop never sees the error
    assert [e.kind for e in watch.events] == ["watch-error"]
    assert "boom inside nbguard" in watch.events[0].message
    assert not watch.attached and hook_counts(model, opt) == before


def test_listeners_get_host_scalars_and_a_failing_one_is_removed():
    model, opt, _ = _setup()
    seen = []

    def good(watch, kind, payload):
        seen.append((kind, payload))

    def bad(watch, kind, payload):
        raise ValueError("dashboard bug")

    watch = nbguard.watch(model, optimizer=opt)
    watch.add_listener(good)
    watch.add_listener(bad)
    train(model, opt, batches(2))
    watch.detach()
    steps = [p for k, p in seen if k == "step"]
    assert [p["step"] for p in steps] == [0, 1]
    assert all(isinstance(p["loss"], float) and isinstance(p["total_grad_norm"], float) for p in steps)
    assert set(steps[0]["grad_norm"]) == set(watch.history.groups)
    errors = [e for e in watch.events if e.kind == "watch-error"]
    assert len(errors) == 1 and "dashboard bug" in errors[0].message
    assert [k for k, p in seen if k == "event"] == ["event"]  # good heard about the removal
    assert watch.step == 2  # the watch itself kept going


@pytest.mark.parametrize("activations", [False, True])
def test_one_host_read_per_optimizer_step(activations):
    counts = {}
    originals = {}
    names = ("item", "tolist", "__bool__", "__float__", "__int__", "cpu", "numpy")

    def counting(name):
        original = getattr(torch.Tensor, name)

        def wrapper(self, *args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return original(self, *args, **kwargs)

        originals[name] = original
        return wrapper

    watches = []

    def run(watched):
        model, opt, _ = _setup()
        data = batches(4)
        watch = nbguard.watch(model, optimizer=opt, activations=activations) if watched else None
        counts.clear()
        for name in names:
            setattr(torch.Tensor, name, counting(name))
        try:
            train(model, opt, data)
        finally:
            for name in names:
                setattr(torch.Tensor, name, originals[name])
        if watch is not None:
            watch.detach()
            watches.append(watch)
        return dict(counts)

    plain, watched = run(False), run(True)
    extra = {k: watched.get(k, 0) - plain.get(k, 0) for k in set(plain) | set(watched)}
    assert {k: v for k, v in extra.items() if v} == {"tolist": 4}
    if activations:  # the abs-max rode along in those four reads
        assert watches[-1].activation_history.steps == [0, 1, 2, 3]


def test_eval_forwards_are_not_micro_batches_and_batches_are_released():
    model, opt, _ = _setup()
    watch = nbguard.watch(model, optimizer=opt)
    batch = batches(1)[0]
    ref = weakref.ref(batch["input_ids"])
    model(**batch).loss.backward()
    model.eval()
    model(**batches(1, seed=5)[0])  # an eval forward in training
    model.train()
    with torch.no_grad():
        model(**batches(1, seed=6)[0])
    assert len(watch._micro_batches) == 1
    opt.step()
    assert watch._micro_batches == []
    del batch
    gc.collect()
    assert ref() is None
    watch.detach()


def test_history_and_document_follow_the_data_contract():
    model, opt, _ = _setup()
    with nbguard.watch(model, optimizer=opt) as watch:
        train(model, opt, batches(3))
    hist = watch.history.to_dict()
    assert set(hist) == {"groups", "steps", "grad_norm", "skipped_steps", "loss", "total_grad_norm", "loss_scale",
                         "update_norm", "total_update_norm"}
    assert hist["steps"] == [0, 1, 2]
    assert len(hist["grad_norm"]) == len(hist["groups"]) and all(len(r) == 3 for r in hist["grad_norm"])
    # the update norms are laid out like the gradient norms, every step's read (the last one at detach)
    assert len(hist["update_norm"]) == len(hist["groups"]) and all(len(r) == 3 for r in hist["update_norm"])
    assert len(hist["total_update_norm"]) == 3 and all(v is not None and v > 0 for v in hist["total_update_norm"])
    assert "model.layers.1.self_attn" in hist["groups"] and "lm_head" in hist["groups"]
    doc = watch.to_document()
    assert doc["kind"] == "watch" and doc["schema_version"] == 1 and doc["history"] == hist
    json.dumps(doc, allow_nan=False)
    assert "3 optimizer steps" in watch.summary()
    assert any(w is watch for w in nbguard.session.SESSION.watches)


def test_a_gradient_spike_is_one_divergence_event_without_a_replay():
    """One judgement of spikes: the run checks' divergence (no ratio-only grad-spike beside it)."""
    model, opt, _ = _setup()
    watch = NanWatch(model, optimizer=opt).attach()
    for i, batch in enumerate(batches(6)):
        loss = model(**batch).loss * (1e4 if i == 5 else 1.0)
        loss.backward()
        opt.step()
        opt.zero_grad()
    watch.detach()
    [event] = watch.events
    assert event.kind == "divergence" and event.step == 5 and event.evidence["ratio"] > 100
    assert "replay_seconds" not in event.evidence and not event.origins
    Event.from_dict(event.to_dict())


def test_watch_document_keeps_one_identity_across_displays():
    import torch

    from nbguard.testing import tiny_llama
    from nbguard.watcher import NanWatch

    model = tiny_llama()
    watch = NanWatch(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    first, second = watch.to_document(), watch.to_document()
    other = NanWatch(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1)).to_document()
    assert first["watch_id"] == second["watch_id"] != other["watch_id"]
