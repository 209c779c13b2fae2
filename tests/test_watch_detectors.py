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
from nbguard.errors import NonFiniteError
from nbguard.findings import Event
from nbguard.testing import tiny_llama
from nbguard.watcher import Detector

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "guides" / "detectors.md"


def guide_namespace(*also: str) -> dict:
    """Run the guide's first code block, then the blocks defining the classes ``also``, as a reader
    would paste them."""
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), re.S)
    namespace: dict = {}
    for code in blocks[:1] + [b for b in blocks[1:] if any(f"class {name}(" in b for name in also)]:
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


def _train(model, opt, steps: int) -> None:
    batch = batches(1)[0]
    for _ in range(steps):
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad()


def _weights(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("policy", ["warn", "skip"])
def test_a_guide_detector_drops_the_update_before_the_optimizer_step_under_skip(policy):
    ExplodedUpdate = guide_namespace("ExplodedUpdate")["ExplodedUpdate"]
    torch.manual_seed(0)
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    watch = nbguard.watch(model, optimizer=opt, policy=policy, detectors=[ExplodedUpdate(limit=0.0)], verify=False)
    before = _weights(model)
    _train(model, opt, 2)
    watch.detach()
    events = [e for e in watch.events if e.kind == "exploded-update"]
    assert [e.step for e in events] == [0, 1] and all(e.evidence["limit"] == 0.0 for e in events)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    if policy == "skip":
        assert unchanged and not opt.state  # AdamW never stepped: no moments, no step count
        assert all(e.evidence["update_dropped"] is True for e in events)
        assert watch.history.skipped_steps == [0, 1]
    else:
        assert not unchanged and all("update_dropped" not in e.evidence for e in events)
        assert watch.history.skipped_steps == []


def test_a_guide_detector_stops_training_before_the_update_under_stop():
    ExplodedUpdate = guide_namespace("ExplodedUpdate")["ExplodedUpdate"]
    torch.manual_seed(0)
    model = tiny_llama()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    watch = nbguard.watch(model, optimizer=opt, policy="stop", detectors=[ExplodedUpdate(limit=0.0)], verify=False)
    before = _weights(model)
    with pytest.raises(NonFiniteError, match="stopped training at step 0: gradient norm"):
        _train(model, opt, 1)
    watch.detach()
    [event] = [e for e in watch.events if e.kind == "exploded-update"]
    assert event.evidence["update_dropped"] is True and watch.stop_requested
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


class StopAfter(Detector):
    """An event at step ``at`` (from update, after the step) that ends training under stop."""

    def __init__(self, at: int):
        self.at = at

    def update(self, view):
        if view.step != self.at:
            return []
        return [Event("exploded-update", view.step, "stop here", evidence={"total_grad_norm": view.total_grad_norm,
                                                                          "limit": 0.0})]

    def stops_training(self, event):
        return True


@pytest.mark.parametrize("policy", ["skip", "stop"])
def test_a_detector_ends_training_after_its_step_only_under_stop(policy):
    guide_namespace("ExplodedUpdate")  # registers the event kind
    torch.manual_seed(0)
    model = tiny_llama()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    watch = nbguard.watch(model, optimizer=opt, policy=policy, detectors=[StopAfter(at=1)], verify=False)
    _train(model, opt, 1)
    before = _weights(model)
    if policy == "stop":
        with pytest.raises(NonFiniteError, match="stopped training at step 1: stop here"):
            _train(model, opt, 1)
    else:
        _train(model, opt, 2)
    watch.detach()
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # step 1 was applied
    assert watch.history.steps == ([0, 1] if policy == "stop" else [0, 1, 2])
    assert watch.history.skipped_steps == []
    [event] = [e for e in watch.events if e.kind == "exploded-update"]
    assert "update_dropped" not in event.evidence


def test_each_hook_reaches_exactly_the_detectors_that_implement_it():
    """The board calls a hook only where a detector defines it (the base's do nothing): a class
    override, a method set on the instance and a duck-typed detector all count; only the detector that
    asked for scalars gets them."""
    calls: list[tuple[str, str, dict]] = []

    class Judges(Detector):
        name = "judges"

        def update(self, view):
            calls.append(("judges", "update", dict(view.scalars)))
            return []

    class Asks(Detector):
        name = "asks"

        def scalars(self, watch):
            return {"ones": torch.ones(2)}

        def before_update(self, view):
            calls.append(("asks", "before_update", dict(view.scalars)))
            return []

    class Duck:  # not a Detector: every method is its own
        def scalars(self, watch):
            return {}

        def update(self, view):
            calls.append(("duck", "update", dict(view.scalars)))
            return []

        def on_log(self, step, logs):
            return []

        def reset_step(self):
            pass

    instance_hooked = Detector()
    instance_hooked.update = lambda view: calls.append(("instance", "update", dict(view.scalars))) or []
    model = tiny_llama()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    watch = nbguard.watch(model, optimizer=opt, detectors=[Judges(), Asks(), Duck(), instance_hooked], verify=False)
    model(**batches(1)[0]).loss.backward()
    opt.step()
    watch.detach()
    assert calls == [("asks", "before_update", {"ones": [1.0, 1.0]}), ("judges", "update", {}),
                     ("duck", "update", {}), ("instance", "update", {})]
