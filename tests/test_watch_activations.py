"""The opt-in activation probe: per-group output abs-max per step, against the fp16 limit."""
import json

import pytest
import torch
from watch_helpers import autocast_ctx, batches, hook_counts, scale_output_to, train

import nbguard
from nbguard.testing import tiny_llama

torch.set_num_threads(1)
LIMIT = 65504.0


def _scale_mlp_output_to(model, mlp, batch, absmax: float) -> None:
    """Plant a large mlp output whose weights still fit fp16: the factor is split over up and down."""
    with torch.no_grad():
        mlp.up_proj.weight.mul_(1e3)
    scale_output_to(model, mlp.down_proj, batch, absmax)
    assert max(p.abs().max().item() for p in mlp.parameters()) < 1e4  # far inside fp16


def _forward_hook_counts(model):
    return {name: len(m._forward_hooks) for name, m in model.named_modules()}


def test_a_scaled_layer_shows_near_the_fp16_limit_and_the_others_far_below():
    model = tiny_llama()
    data = batches(2)
    _scale_mlp_output_to(model, model.model.layers[1].mlp, data[0], 5e4)  # in range for fp16, 1.3x headroom
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    with nbguard.watch(model, optimizer=opt, activations=True) as watch:
        train(model, opt, data, autocast=torch.float16)
    assert [e.kind for e in watch.events] == []
    acts = watch.to_document()["activations"]
    json.dumps(acts, allow_nan=False)
    assert acts["limit"] == LIMIT and acts["steps"] == [0, 1]
    assert acts["groups"] == watch.history.groups  # every tiny-Llama group is a module
    rows = dict(zip(acts["groups"], acts["absmax"]))
    assert all(len(r) == 2 for r in rows.values())
    assert 0.5 * LIMIT < rows["model.layers.1.mlp"][0] <= LIMIT
    others = [v for g, r in rows.items() if g != "model.layers.1.mlp" for v in r]
    assert max(others) < 1e-2 * LIMIT


def test_an_overflowing_layer_reads_inf_and_nothing_else_does():
    model = tiny_llama()
    data = batches(1)
    _scale_mlp_output_to(model, model.model.layers[0].mlp, data[0], 2e5)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    with nbguard.watch(model, optimizer=opt, activations=True, localize=False) as watch:
        train(model, opt, data, autocast=torch.float16)
    assert [e.kind for e in watch.events] == ["nonfinite-loss"]
    rows = dict(zip(*(watch.to_document()["activations"][k] for k in ("groups", "absmax"))))
    assert rows["model.layers.0.mlp"] == ["inf"]
    # the residual stream carries the inf onward; layers before the fault stay finite
    assert isinstance(rows["model.embed_tokens"][0], float) and isinstance(rows["model.layers.0.self_attn"][0], float)


def test_max_over_training_micro_batches_and_eval_forwards_excluded():
    model = tiny_llama()
    mlp = model.model.layers[0].mlp
    seen = []  # what the test itself measures on every forward of the group module
    mlp.register_forward_hook(lambda m, a, out: seen.append(out.detach().abs().max().item()))
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    data = batches(3)
    watch = nbguard.watch(model, optimizer=opt, activations=True)
    for batch in data[:2]:  # two micro-batches, one optimizer step
        (model(**batch).loss / 2).backward()
    training = list(seen)
    with torch.no_grad():  # an evaluation in the middle of the step, with larger outputs
        mlp.down_proj.weight.mul_(10.0)
        model(**data[2])
        model.eval()
        model(**data[2])
        model.train()
        mlp.down_proj.weight.div_(10.0)
    opt.step()
    watch.detach()
    assert len(seen) == 4 and max(seen[2:]) > 5 * max(training)
    [[value]] = [r for g, r in zip(*(watch.activation_history.to_dict()[k] for k in ("groups", "absmax")))
                 if g == "model.layers.0.mlp"]
    assert value == pytest.approx(max(training), rel=1e-6)


def test_off_by_default_adds_no_hooks_and_no_section():
    model = tiny_llama()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    before = _forward_hook_counts(model)
    with nbguard.watch(model, optimizer=opt) as watch:
        assert _forward_hook_counts(model) == {k: v + (k == "") for k, v in before.items()}  # the root hook only
        train(model, opt, batches(1))
    assert watch.activation_history is None and "activations" not in watch.to_document()


def test_hooks_on_each_group_module_and_detach_restores_every_count():
    model = tiny_llama()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    before, forward_before = hook_counts(model, opt), _forward_hook_counts(model)
    watch = nbguard.watch(model, optimizer=opt, activations=True)
    after = _forward_hook_counts(model)
    grew = {k for k in after if after[k] != forward_before[k]}
    assert grew == set(watch.history.groups) | {""}
    train(model, opt, batches(1))
    watch.detach()
    assert hook_counts(model, opt) == before
    watch.attach()  # re-attachable, and a second detach leaves nothing either
    assert _forward_hook_counts(model) == after
    watch.detach()
    assert hook_counts(model, opt) == before


def test_an_error_inside_an_activation_hook_is_recorded_and_training_goes_on(monkeypatch):
    from nbguard.watcher.reads import activations

    def broken(output):
        raise RuntimeError("boom in the probe")

    monkeypatch.setattr(activations, "output_absmax", broken)
    model = tiny_llama()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    before = hook_counts(model, opt)
    watch = nbguard.watch(model, optimizer=opt, activations=True)
    with pytest.warns(RuntimeWarning, match="detached after an internal error"):
        losses = train(model, opt, batches(3))
    assert len(losses) == 3 and all(torch.isfinite(loss) for loss in losses)
    assert [e.kind for e in watch.events] == ["watch-error"] and "boom in the probe" in watch.events[0].message
    assert not watch.attached and hook_counts(model, opt) == before


def test_bad_activations_argument_is_a_type_error():
    model = tiny_llama()
    with pytest.raises(TypeError, match="activations must be True or False"):
        nbguard.watch(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), activations="yes")
