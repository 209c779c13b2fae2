"""Replay under the things Unsloth does to a model (issue 12 section 2): functions compiled with
torch.compile called inside forward, fused kernels that use submodules' weights without calling
them, and a bad step the eager replay cannot reproduce."""
from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from watch_helpers import batches, scale_output_to, train

import nbguard
from nbguard.testing import tiny_llama

torch.set_num_threads(1)
MODES: list[bool] = []  # torch.compiler.is_compiling() as seen inside the fused function, per call


def swiglu(x, gate_w, up_w, down_w):
    """Unsloth-style fused MLP: the three projections' weights used directly, no module call."""
    MODES.append(torch.compiler.is_compiling())
    return F.linear(F.silu(F.linear(x, gate_w)) * F.linear(x, up_w), down_w)


FUSED = torch.compile(swiglu, backend="aot_eager", dynamic=False)


def fused_forward(self, x):
    return FUSED(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)


def _overflowing_model(fused: bool):
    model = tiny_llama()
    data = batches(2)
    scale_output_to(model, model.model.layers[1].mlp.up_proj, data[0], 2e5)  # inf in fp16
    if fused:
        model.model.layers[1].mlp.forward = types.MethodType(fused_forward, model.model.layers[1].mlp)
    return model, data


def _watch(model, data):
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with nbguard.watch(model, optimizer=opt) as watch:
        train(model, opt, data[:1], autocast=torch.float16)
    return watch


def test_a_fused_compiled_kernel_is_localised_to_its_enclosing_module_and_the_event_says_so():
    model, data = _overflowing_model(fused=True)
    MODES.clear()
    watch = _watch(model, data)
    event = watch.events[0]
    origin = event.origin("forward")
    assert origin.module == "model.layers.1.mlp", watch.summary()
    assert event.cause == "invalid-op"  # the inf made inside became NaN in down_proj before leaving the kernel
    assert "model.layers.1.mlp.up_proj" in origin.evidence["bypassed_children"]
    assert "bypassing their hooks" in origin.evidence["note"]
    assert "fused kernel bypassed" in event.message
    # the training forward ran the compiled function, the replay ran it eagerly
    assert MODES[0] is True and MODES[-1] is False


def test_without_the_fused_kernel_the_child_itself_is_named():
    model, data = _overflowing_model(fused=False)
    origin = _watch(model, data).events[0].origin("forward")
    assert origin.module == "model.layers.1.mlp.up_proj" and "bypassed_children" not in origin.evidence


class FlakyOnce(torch.nn.Module):
    """SiLU that returns NaN on its first call only: a fault an eager replay cannot repeat."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return F.silu(x) * (float("nan") if self.calls == 1 else 1.0)


def _flaky_run(unsloth: bool):
    model = tiny_llama()
    model.model.layers[0].mlp.act_fn = FlakyOnce()
    if unsloth:
        model.config.update({"unsloth_version": "2026.10.9"})
        model._unsloth_forced_float32 = False
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with nbguard.watch(model, optimizer=opt) as watch:
        train(model, opt, batches(2))
    return watch


def test_a_step_the_replay_cannot_reproduce_says_what_to_try_next():
    watch = _flaky_run(unsloth=False)
    [event] = watch.events
    assert event.cause == "not-reproducible" and event.step == 0
    steps = event.evidence["next_steps"]
    assert "force_eager" in steps[0] and "TORCHDYNAMO_DISABLE=1" in steps[0]
    assert any("use_deterministic_algorithms" in s for s in steps)
    assert not any("UNSLOTH" in s for s in steps)
    assert "not reproduced by an eager replay" in event.message
    from nbguard.document.view import view
    from nbguard.render import render_text

    card = view(watch.to_document()).section("watch").cards[0]
    assert [line for line in card.lines if line.startswith("try next: ")] == [f"try next: {s}" for s in steps]
    assert f"try next: {steps[0]}" in render_text(watch.to_document()).replace("\n      ", " ")


def test_on_an_unsloth_model_the_first_thing_to_try_is_its_compile_switch():
    steps = _flaky_run(unsloth=True).events[0].evidence["next_steps"]
    assert steps[0].startswith("Unsloth: set UNSLOTH_COMPILE_DISABLE=1")
