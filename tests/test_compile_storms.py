"""Compile storms (issue 43 item 5): the step clock names what torch.compile did in a ``slow-steps`` episode.

Real compiles on CPU (dynamo with the eager backend: the guards, recompiles, graph breaks and the recompile
limit are dynamo's own, only code generation is skipped). The slowness is planted by real recompiles, counted
by dynamo: the assertions are on the cause the event names, never on seconds.
"""
from __future__ import annotations

import pytest
import torch
import torch._dynamo

import nbguard
from nbguard.introspect.dynamo_guards import guard_kind
from nbguard.watcher.components.compile_log import CompileLog
from nbguard.watcher.components.stall import StepClock

FEATURES = 8
PADDED = 32  # the fix: every batch padded to one length


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def block_model() -> torch.nn.Module:
    """A small model whose first block is compiled as users compile layers (the watch's hooks stay outside)."""
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.ReLU())
    model = torch.nn.Sequential(block, torch.nn.Linear(16, 1))
    model[0] = torch.compile(block, backend="eager", dynamic=False)
    return model


def batch(step: int, storm_steps: range, pad: bool) -> torch.Tensor:
    """A batch of 2 sequences; in ``storm_steps`` each step's sequences are longer than any before."""
    length = 4 + step if step in storm_steps else 4
    x = torch.randn(2, length, FEATURES)
    if pad:  # pad to a fixed length: one shape, one graph
        x = torch.nn.functional.pad(x, (0, 0, 0, PADDED - length))
    return x


def run(pad: bool, steps: int = 24, storm_steps: range = range(14, 19)):
    model = block_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    watch = nbguard.watch(model, optimizer=optimizer, verify=False, log_to=None,
                          config=nbguard.WatchConfig(stall={"after_s": 60.0}))
    try:
        for step in range(steps):
            model(batch(step, storm_steps, pad)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    finally:
        watch.detach()
    return watch


def test_a_shape_recompile_storm_is_a_slow_steps_event_naming_recompiles_and_its_padded_twin_is_quiet():
    watch = run(pad=False)
    assert [e.kind for e in watch.events] == ["slow-steps"], watch.summary()
    event = watch.events[0]
    cause = event.evidence["cause"]
    assert cause["cause"] == "recompiles"
    assert set(cause["compiling_steps"]) >= set(range(event.step, event.step + 4))  # every slow step recompiled
    assert cause["recompiles"] >= 4 and cause["gave_up"] == 0 and not cause["limit_hit"]
    assert any("size mismatch" in reason for reason in cause["reasons"]), cause["reasons"]
    assert cause["functions"] == ["a module compiled with torch.compile(module)"]
    assert "pad to a fixed length" in cause["fix"] and "dynamic=True" in cause["fix"]
    assert "torch.compile recompiled" in event.message and "size mismatch" in event.message

    # the fix applied: the same run with every batch padded to one length compiles once, in the first step
    twin = run(pad=True)
    assert twin.events == [], twin.summary()
    (clock,) = [d for d in twin.detectors if isinstance(d, StepClock)]
    assert [r.step for r in clock.compiles.records] == [0]


def compiled_steps(fn, inputs) -> CompileLog:
    """Call ``fn`` once per step on each input, ticking a fresh log after each."""
    log = CompileLog()
    for step, args in enumerate(inputs):
        fn(*args)
        log.tick(step)
    return log


def test_a_python_number_that_changes_each_step_is_named_as_a_value_guard():
    lin = torch.nn.Linear(4, 4)
    scaled = torch.compile(lambda x, n: lin(x).sum() * n, backend="eager", dynamic=False)
    log = compiled_steps(scaled, [(torch.randn(2, 4), step) for step in range(4)])
    cause = log.cause(1, 3)
    assert cause is not None and cause["cause"] == "recompiles" and cause["compiling_steps"] == [1, 2, 3]
    assert guard_kind(cause["reasons"]) == "value", cause["reasons"]
    assert "torch.tensor(value)" in cause["fix"]


def test_the_recompile_limit_hit_is_named_as_a_fall_back_to_eager():
    lin = torch.nn.Linear(4, 4)
    summed = torch.compile(lambda x: lin(x).sum(), backend="eager", dynamic=False)
    with torch._dynamo.config.patch(recompile_limit=2):
        log = compiled_steps(summed, [(torch.randn(rows, 4),) for rows in range(1, 6)])
    cause = log.cause(1, 4)
    assert cause is not None and cause["cause"] == "eager-fallback" and cause["limit_hit"]
    assert "runs uncompiled (eager)" in cause["fix"] and "pad to a fixed length" in cause["fix"]
    # after the limit the frame runs eagerly: the later steps compile nothing
    assert max(cause["compiling_steps"]) <= 2


def test_a_new_graph_break_is_named_and_a_step_that_compiled_nothing_leaves_no_record():
    def noisy(x):
        y = x.sum()
        torch._dynamo.graph_break()  # (a print breaks the graph too, but what print runs depends on the process:
        return y * 2                 # after TRL's imports dynamo compiled 19 frames for it, giving up on some)

    broken = torch.compile(noisy, backend="eager")
    x = torch.randn(3)
    log = compiled_steps(broken, [(x,), (x,), (x,)])
    assert [r.step for r in log.records] == [0]  # the same call again: the cached graphs, no record
    cause = log.cause(0, 0)
    assert cause is not None and cause["cause"] == "graph-breaks"
    assert any("graph_break" in line for line in cause["graph_breaks"]), cause["graph_breaks"]
    assert log.cause(1, 2) is None


def test_what_compiled_before_the_watch_is_not_the_runs_and_a_reset_starts_over():
    lin = torch.nn.Linear(4, 4)
    summed = torch.compile(lambda x: lin(x).sum(), backend="eager", dynamic=False)
    summed(torch.randn(2, 4))
    summed(torch.randn(3, 4))  # a recompile before the log exists
    log = CompileLog()
    log.tick(0)
    assert list(log.records) == []
    torch._dynamo.reset()  # the counters go back to zero
    log.tick(1)
    summed(torch.randn(5, 4))
    log.tick(2)
    assert [r.step for r in log.records] == [2]
