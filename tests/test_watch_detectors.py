"""A detector defined outside the package plugs into the watch through the public pipeline."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import nbguard
from nbguard.findings import Event
from nbguard.testing import tiny_llama
from nbguard.watcher import Detector
from tests.watch_helpers import batches

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "guides" / "detectors.md"


def guide_namespace() -> dict:
    """Run the guide's first code block, as a reader would paste it."""
    code = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), re.S)[0]
    namespace: dict = {}
    exec(compile(code, str(GUIDE), "exec"), namespace)
    return namespace


class LogRecorder(Detector):
    """Sees every logged metrics dict; reports the first with a reward."""

    def __init__(self):
        self.logs: list[dict] = []

    def on_log(self, step, logs):
        self.logs.append(logs)
        return []


def test_a_detector_from_the_guide_reports_in_events_document_and_report():
    LossPlateau = guide_namespace()["LossPlateau"]
    torch.manual_seed(0)
    model = tiny_llama()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: the loss stays flat
    plateau = LossPlateau(steps=3)
    watch = nbguard.watch(model, optimizer=opt, detectors=[plateau], verify=False)
    batch = batches(1)[0]
    for _ in range(4):
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad()
    watch.detach()
    [event] = [e for e in watch.events if e.kind == "loss-plateau"]
    assert event.step == 2 and event.evidence["steps"] == 3
    expected_max = max(p.detach().abs().max().item() for p in model.parameters())
    assert event.evidence["weight_max"] == pytest.approx(expected_max)
    assert plateau in watch.detectors
    assert [e["kind"] for e in watch.to_document()["events"]] == ["loss-plateau"]
    assert "loss flat" in nbguard.report(watch=watch).to_markdown()
    Event.from_dict(event.to_dict())


def test_add_detector_later_and_bad_detectors_are_refused():
    model = tiny_llama()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="instance, not the class"):
        nbguard.watch(model, optimizer=opt, detectors=[LogRecorder])
    with pytest.raises(TypeError, match="is not a detector"):
        nbguard.watch(model, optimizer=opt, detectors=[object()])
    watch = nbguard.watch(model, optimizer=opt, verify=False)
    recorder = watch.add_detector(LogRecorder())
    watch.record_log({"reward": 0.5, "loss": 1.0})
    watch.detach()
    assert recorder.logs == [{"reward": 0.5, "loss": 1.0}]


def test_unregistered_event_kind_is_refused_with_the_way_to_register():
    with pytest.raises(ValueError, match="register_event_kind"):
        Event("never-registered", 0, "x")
