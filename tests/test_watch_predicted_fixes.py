"""Issue 41, item 4: what the audit predicted feeds the watch's candidate fixes, and a step whose weights were
already non-finite is not used to call a fix "not enough".

A real plain loop: a small float16 network under Adam with its default eps=1e-8, which is 0 in float16, so the
first updates make weights inf (the audit's adam-eps-underflow finding says so before training).
"""
from __future__ import annotations

import pytest
import torch

import nbguard
from nbguard.session import SESSION

torch.set_num_threads(1)


class Net(torch.nn.Module):
    """A two-layer network that returns its loss (nanoGPT-style), so a step re-run computes it."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 1)

    def forward(self, x, y):
        out = self.fc2(torch.relu(self.fc1(x)))
        return out, ((out.float() - y.float()) ** 2).mean()


@pytest.fixture(autouse=True)
def _fresh_session():
    SESSION.clear()
    yield
    SESSION.clear()


def _fp16_adam_run(audit: bool):
    torch.manual_seed(0)
    model = Net().to(torch.float16)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)  # eps=1e-8: 0.0 in float16
    if audit:
        assert "adam-eps-underflow" in nbguard.audit(model, optimizer=optimizer)
    with nbguard.watch(model, optimizer=optimizer, policy="skip") as watch:
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
            optimizer.zero_grad()
            _, loss = model(x.half(), y.half())
            loss.backward()
            optimizer.step()
    [event] = [e for e in watch.events if e.kind.startswith("nonfinite")]
    assert event.cause == "nonfinite-parameter"
    return watch


@pytest.mark.parametrize("audit", [True, False], ids=["audited", "not-audited"])
def test_the_predicted_fixes_come_first_and_no_verdict_blames_them(audit):
    watch = _fp16_adam_run(audit)
    verdicts = watch.verification.verdicts
    offered = [v.fix for v in verdicts]
    assert offered[:2] == ["optimizer-eps-for-dtype", "upcast-trainable-fp32"], offered
    # the weights were inf before the step ran: re-running it cannot judge any fix, and no verdict says it can
    assert all(v.verdict != "not enough" for v in verdicts), [(v.fix, v.verdict, v.reason) for v in verdicts]
    upcast = watch.verification.verdict("upcast-trainable-fp32")
    assert upcast.verdict == "not checked" and "already non-finite when this step began" in upcast.reason
    assert "fc1.weight" in watch.verification.step_skipped
