"""A detector defined outside the package plugs into the watch through the public pipeline."""
from __future__ import annotations

import re
from pathlib import Path

import jsonschema
import pytest
import torch
from watch_helpers import batches

import nbguard
from nbguard.document import encode_document
from nbguard.document.schema import schema
from nbguard.findings import Event
from nbguard.testing import tiny_llama
from nbguard.watcher import Detector

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "guides" / "detectors.md"


def guide_namespace() -> dict:
    """Run the guide's first code block, as a reader would paste it."""
    code = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), re.S)[0]
    namespace: dict = {}
    exec(compile(code, str(GUIDE), "exec"), namespace)
    return namespace


class LogRecorder(Detector):
    """Records every metrics dict the trainer (or a loop) logs; reports nothing."""

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
    doc = watch.to_document()
    assert [e["kind"] for e in doc["events"]] == ["loss-plateau"]
    jsonschema.Draft202012Validator(schema()).validate(encode_document(doc))  # the kind is in the schema now
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


def test_trainer_logs_reach_on_log_after_each_step():
    """The Trainer's metrics (TRL's rewards arrive the same way) reach every detector's on_log."""
    import tempfile

    from transformers import Trainer, TrainingArguments

    from nbguard.testing import TinyDataset

    model = tiny_llama()
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), max_steps=3, per_device_train_batch_size=2, use_cpu=True,
                             report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=TinyDataset(16))
    recorder = LogRecorder()
    watch = nbguard.watch(trainer, detectors=[recorder], verify=False)
    trainer.train()
    watch.detach()
    step_logs = [logs for logs in recorder.logs if "loss" in logs]
    assert len(step_logs) == 3 and all(isinstance(logs["grad_norm"], float) for logs in step_logs)
