"""Issue 45 item 5: the watch under ``torch.compile`` adds no graph break and no graph to the user's compiled
model (counted with dynamo's own counters), in both read modes, and reads each step's loss."""
from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import nbguard
from nbguard.testing import tiny_batch, tiny_llama
from nbguard.watcher import WatchSettings


def _compiled_run(read: str | None, steps: int = 3):
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    compiled = torch.compile(model)
    watch = None if read is None else nbguard.watch(compiled, optimizer=opt, policy="skip", log_to=None, verify=False,
                                                    settings=WatchSettings(read=read))
    losses = []
    for step in range(steps):
        loss = compiled(**tiny_batch(seed=step)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    if watch is not None:
        watch.detach()
    return watch, losses, dict(counters["graph_break"]), counters["stats"]["unique_graphs"], model


@pytest.fixture(scope="module")
def unwatched():
    return _compiled_run(None)  # compiled once for both modes: compiling is most of these tests' time


@pytest.mark.parametrize("read", ["host", "deferred"])
def test_a_compiled_model_gets_no_graph_break_and_no_graph_from_the_watch(read, unwatched):
    _, twin_losses, twin_breaks, twin_graphs, twin = unwatched
    watch, losses, breaks, graphs, model = _compiled_run(read)
    assert breaks == twin_breaks == {}
    assert graphs == twin_graphs
    assert watch.events == [] and watch.step == 3
    assert watch.history.loss == [loss.item() for loss in losses]
    assert all(torch.equal(a, b) for a, b in zip(losses, twin_losses))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))


def test_a_watch_on_the_module_inside_a_fullgraph_compile_stays_out_of_the_trace():
    """Watching the eager module and calling the compiled one (dynamo then traces the watch's hooks): under
    ``fullgraph=True, dynamic=False`` a Python call in a hook is an error and every count it reads a recompile
    (a storm that hit the recompile limit at step 8). The watch stays out of the trace: one graph, no break, no
    recompile; it says once what it cannot see there, and still catches a non-finite gradient at its step."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    compiled = torch.compile(model, backend="eager", dynamic=False, fullgraph=True)
    data = torch.Generator().manual_seed(1)
    with pytest.warns(RuntimeWarning, match="inside torch.compile's trace") as caught:
        watch = nbguard.watch(model, optimizer=opt, verify=False, log_to=None)
        for step in range(12):
            x = torch.randn(4, 8, generator=data)
            if step == 9:
                x[0, 0] = float("inf")
            compiled(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        watch.detach()
    assert len([w for w in caught if "torch.compile's trace" in str(w.message)]) == 1
    assert counters["graph_break"] == {} and counters["stats"]["unique_graphs"] == 1
    assert [(e.kind, e.step) for e in watch.events] == [("nonfinite-grad", 9)]
