"""The recompile-limit error explained (issue 43 item 5): FailOnRecompileLimitHit at step 0 (unsloth#6825).

A real storm: one compiled function called on every layer with the layer's own window (a Python int the
guards specialise on, as with dynamic=False), with fail_on_recompile_limit_hit set as Unsloth sets it. The
diagnosis names the function, the guard and the limit to set; applied, the same step runs. Its twin, whose
layers share one window, compiles once and raises nothing.
"""
from __future__ import annotations

import pytest
import torch
import torch._dynamo

import nbguard
from nbguard.explainer import diagnose

LAYERS = 4


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=2, fail_on_recompile_limit_hit=True):
        yield
    torch._dynamo.reset()


def attend(x: torch.Tensor, window: int) -> torch.Tensor:
    return x + x[..., -window:].mean(-1, keepdim=True)


def first_step(windows: list[int]) -> torch.Tensor:
    """Step 0 of a model whose layers call one compiled function, each with its own window."""
    torch.manual_seed(0)
    compiled = torch.compile(attend, backend="eager", dynamic=False)
    x = torch.randn(2, 8)
    for window in windows:
        x = compiled(x, window)
    return x


def test_the_recompile_limit_at_step_0_is_explained_and_the_limit_it_names_clears_it():
    # another compiled function recompiled more often earlier in this process: the diagnosis still names the
    # function that hit the limit (the code dynamo was compiling when it raised)
    other = torch.compile(lambda x: x.sin().sum(), backend="eager", dynamic=False)
    with torch._dynamo.config.patch(recompile_limit=8, fail_on_recompile_limit_hit=False):
        for rows in range(1, 7):
            other(torch.randn(rows))
    with pytest.raises(Exception) as raised:
        first_step(list(range(1, LAYERS + 1)))
    assert type(raised.value).__name__ == "FailOnRecompileLimitHit"
    diagnosis = nbguard.explain(raised.value)
    assert diagnosis is not None and diagnosis.signature == "torch-compile-recompile-limit", diagnosis
    evidence = diagnosis.evidence
    assert evidence["limit"] == 2 and evidence["limit_type"] == "recompile_limit"
    assert evidence["function"].startswith("attend (") and evidence["guard_failures"] >= 2
    assert evidence["guard_kind"] == "value" and any("window == " in r for r in evidence["reasons"]), evidence
    assert "unsloth#6825" in diagnosis.detail and "torch.tensor(value)" in diagnosis.detail
    limit = evidence["suggested_recompile_limit"]
    assert f"recompile_limit = {limit}" in diagnosis.detail

    # the fix, applied as the diagnosis writes it: the same first step runs
    with torch._dynamo.config.patch(recompile_limit=limit):
        assert first_step(list(range(1, LAYERS + 1))).isfinite().all()

    # the twin, whose layers share one window, compiles once: no guard fails, nothing to explain
    torch._dynamo.reset()
    assert first_step([2] * LAYERS).isfinite().all()
    assert not any(torch._dynamo.utils.guard_failures.values())


def test_dynamos_own_unsupported_error_and_a_recompile_error_are_explained_too():
    with pytest.raises(Exception) as raised:
        first_step([1, 2, 3])
    cause = raised.value.__cause__  # torch._dynamo.exc.Unsupported: "Dynamo recompile limit exceeded ..."
    assert cause is not None and "recompile limit exceeded" in str(cause).lower()
    diagnosis = diagnose(cause)
    assert diagnosis is not None and diagnosis.signature == "torch-compile-recompile-limit"
    assert diagnosis.evidence["limit"] == 2  # read from the message itself

    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True), pytest.raises(Exception) as recompiled:
        first_step([1, 2])
    assert type(recompiled.value).__name__ == "RecompileError"
    diagnosis = diagnose(recompiled.value)
    assert diagnosis is not None and diagnosis.signature == "torch-compile-recompile-limit"
    assert "error_on_recompile" in diagnosis.title and diagnosis.evidence["guard_kind"] == "value"

    unrelated = diagnose(RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)"))
    assert unrelated is None or unrelated.signature != "torch-compile-recompile-limit"
