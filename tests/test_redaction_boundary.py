"""Issue 40 item 3 / finding 4: every string that leaves the process passes one boundary
(``nbguard.document.outward``). Secrets planted in exception messages (an ``hf_`` token, an ``api_key=``,
a URL with a password, a home path) are absent from each real exit: TensorBoard event files written by a
real SummaryWriter, a real trackio run (its alert printed into the cell output and stored), an offline
W&B run, warnings, ``repr``/``str`` of ``explain()`` results, the saved report. The walk of the source that
enumerates the exits is tests/test_redaction_exits.py."""
from __future__ import annotations

import os
import sys
import tempfile
import uuid

import pytest
import torch
from boundary_helpers import SECRET_MESSAGE, leaks_in, leaks_under
from watch_helpers import batches, train

import nbguard
from nbguard.testing import tiny_llama
from nbguard.watcher.reads import activations

torch.set_num_threads(1)


def _broken_probe(monkeypatch):
    """The activation probe raises an error that quotes secrets: an internal error of the watch."""
    def broken(output):
        raise RuntimeError(SECRET_MESSAGE)

    monkeypatch.setattr(activations, "output_absmax", broken)


def _failing_listener(watch, kind, payload):
    if kind == "step":
        raise ConnectionError(SECRET_MESSAGE)  # a listener's error: the watch-error event quotes it


def test_internal_error_warning_event_tensorboard_and_saved_report_hold_no_secret(monkeypatch, tmp_path):
    pytest.importorskip("tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    _broken_probe(monkeypatch)
    model = tiny_llama()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    writer = SummaryWriter(str(tmp_path / "tb"))
    watch = nbguard.watch(model, optimizer=opt, activations=True, verify=False, log_to=writer, log_every=1)
    with pytest.warns(RuntimeWarning, match="detached after an internal error") as caught:
        train(model, opt, batches(2))
    writer.close()
    [event] = watch.events
    assert event.kind == "watch-error" and "upload failed" in event.message  # the local record keeps the text
    warned = [str(w.message) for w in caught]
    assert warned and not any(leaks_in(text) for text in warned), warned
    assert "[REDACTED]" in warned[0]
    assert leaks_under(tmp_path / "tb") == {}, "TensorBoard's event files got a secret"
    for name in ("r.html", "r.json", "r.md"):
        path = nbguard.report(watch=watch).save(tmp_path / name)
        assert leaks_in(path.read_text()) == [], name
    for shown in (repr(watch), str(watch), repr(event), repr(watch.events)):
        assert leaks_in(shown) == []


def test_a_listener_error_reaches_tensorboard_text_redacted(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util
    from torch.utils.tensorboard import SummaryWriter

    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    writer = SummaryWriter(str(tmp_path))
    watch = nbguard.watch(model, optimizer=opt, verify=False, log_to=writer, log_every=1)
    watch.add_listener(_failing_listener)
    train(model, opt, batches(2))
    watch.detach()
    writer.close()
    acc = EventAccumulator(str(tmp_path), size_guidance={"tensors": 0})
    acc.Reload()
    [text] = [tensor_util.make_ndarray(t.tensor_proto).item().decode()
              for t in acc.Tensors("nbguard/events/text_summary")]
    assert text.startswith("**watch-error**") and "[REDACTED]" in text and "~/finetune" in text
    assert leaks_in(text) == [] and leaks_under(tmp_path) == {}


def _train_logging_a_failure_to(run) -> None:
    """Two steps watched into ``run``, whose listener fails with the planted secrets; the run finished."""
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    watch = nbguard.watch(model, optimizer=opt, verify=False, log_to=run, log_every=1)
    watch.add_listener(_failing_listener)
    train(model, opt, batches(2))
    watch.detach()
    run.finish()


def test_trackio_alert_printed_and_stored_holds_no_secret(capfd):
    if "trackio" not in sys.modules:  # trackio reads TRACKIO_DIR once, at import
        os.environ.setdefault("TRACKIO_DIR", tempfile.mkdtemp(prefix="nbguard-trackio-"))
    trackio = pytest.importorskip("trackio")
    from trackio.sqlite_storage import SQLiteStorage

    project = f"nbguard-{uuid.uuid4().hex[:8]}"
    run = trackio.init(project=project, name="leak")
    _train_logging_a_failure_to(run)
    printed = capfd.readouterr()
    [alert] = SQLiteStorage.get_alerts(project, run_name="leak")
    assert alert["title"].startswith("nbguard: watch-error") and "[REDACTED]" in alert["text"]
    assert leaks_in(alert["text"]) == [] and leaks_in(printed.out + printed.err) == []
    logged = [row["nbguard/event"] for row in SQLiteStorage.get_logs(project, "leak") if "nbguard/event" in row]
    assert logged and not any(leaks_in(text) for text in logged)


def test_offline_wandb_run_file_holds_no_secret(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_PROJECT", "nbguard-test")
    try:
        _train_logging_a_failure_to(wandb.init())
    finally:
        wandb.teardown()  # only then is the run file written out whole
    [path] = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    data = path.read_bytes()
    assert b"watch-error" in data and b"[REDACTED]" in data
    assert leaks_in(data) == []


def test_trainer_report_to_warning_holds_no_secret(monkeypatch, tmp_path):
    pytest.importorskip("tensorboard")
    from trackers_helpers import trainer_run

    from nbguard.trackers import scalars

    def broken(self, payload):
        raise RuntimeError(SECRET_MESSAGE)

    monkeypatch.setattr(scalars.StepScalars, "of", broken)
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    with pytest.warns(RuntimeWarning, match="stopped adding its scalars") as caught:
        trainer_run(["tensorboard"], steps=2, output_dir=str(tmp_path / "out"))
    warned = [str(w.message) for w in caught if "stopped adding" in str(w.message)]
    assert warned and "[REDACTED]" in warned[0] and leaks_in(warned[0]) == []


CUDA_NO_KERNEL = "CUDA error: no kernel image is available for execution on the device\n"


def test_repr_and_str_of_explain_results_hold_no_secret():
    diagnosis = nbguard.explain(RuntimeError(CUDA_NO_KERNEL + SECRET_MESSAGE))
    assert diagnosis is not None and diagnosis.signature == "cuda-no-kernel-image"
    assert "upload failed" in diagnosis.exception  # the object keeps what it saw; what it shows is redacted
    for shown in (repr([diagnosis]), repr(diagnosis), str(diagnosis), str([diagnosis]),
                  str(diagnosis._repr_mimebundle_())):
        assert leaks_in(shown) == [], shown
    assert repr(diagnosis).startswith("Diagnosis(signature='cuda-no-kernel-image'")


def test_repr_of_verification_parts_holds_no_secret():
    from nbguard.verifier.result import FixVerdict, Verification

    verdict = FixVerdict(fix="upcast-trainable-fp32", options={}, verdict="not checked", reason=SECRET_MESSAGE)
    verification = Verification(subject="x", verdicts=[verdict])
    for shown in (repr(verdict), repr([verification]), str(verification)):
        assert leaks_in(shown) == [], shown
