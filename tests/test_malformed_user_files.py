"""#40 finding 7: a malformed file in a user's folder is a finding naming the file and what was wrong, never an
exception or a hang. Real checkpoints from a Trainer run and real PEFT adapters, then one file broken the way a
download, a full disk or an attacker breaks it."""
from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import struct
import threading
import warnings

import pytest
import torch

import nbguard
from nbguard.introspect.user_files import (
    UserFileError,
    json_depth,
    read_json_object,
    safetensors_header,
)
from nbguard.testing import TinyDataset, tiny_llama

pytestmark = pytest.mark.filterwarnings("ignore")


def _finishes(fn, seconds: float = 120.0, fifo: str | None = None):
    """fn() in a daemon thread; its result, or a failure when it has not returned in time (a FIFO read hangs:
    a writer is then opened and closed on the FIFO so the thread ends)."""
    out: dict = {}

    def target():
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - reported below
            out["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        if fifo is not None:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail(f"did not return in {seconds} s (blocked on a file)")
    if "error" in out:
        raise out["error"]
    return out["value"]


# ---- the reader --------------------------------------------------------------------------------
def test_reader_refuses_fifos_depth_lists_and_huge_header_lengths(tmp_path):
    fifo = tmp_path / "adapter_config.json"
    os.mkfifo(fifo)
    with pytest.raises(UserFileError, match="FIFO"):
        _finishes(lambda: read_json_object(str(fifo)), 20, str(fifo))
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(UserFileError, match=r"list.json: holds a list where a JSON object belongs"):
        read_json_object(str(tmp_path / "list.json"))
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(UserFileError, match="nested 100000 deep"):
        read_json_object(str(tmp_path / "deep.json"))
    assert json_depth(b'{"a": "[[[[", "b": [1, {"c": "\\"]]"}]}') == 3  # brackets in strings do not count
    (tmp_path / "w.safetensors").write_bytes(struct.pack("<Q", 2 ** 62) + b"{}")
    with pytest.raises(UserFileError, match="header of 4611686018427387904 bytes"):
        safetensors_header(str(tmp_path / "w.safetensors"))


# ---- resume audits -----------------------------------------------------------------------------
def _trainer(out, model=None):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(out), use_cpu=True, report_to=[], save_strategy="steps", save_steps=2,
                             max_steps=2, per_device_train_batch_size=4, logging_steps=1, disable_tqdm=True,
                             learning_rate=1e-3)
    return Trainer(model=model if model is not None else tiny_llama(), args=args, train_dataset=TinyDataset(16, 16))


@pytest.fixture(scope="module")
def saved_checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _trainer(out).train()
    return out / "checkpoint-2"


@pytest.fixture
def checkpoint(saved_checkpoint, tmp_path):
    copy = tmp_path / "checkpoint-2"
    shutil.copytree(saved_checkpoint, copy)
    return copy


def _unreadable(tmp_path, checkpoint) -> dict:
    result = _finishes(lambda: nbguard.audit(trainer=_trainer(tmp_path / "new"), resume_from_checkpoint=str(checkpoint)))
    f = result.finding("resume-checkpoint-incomplete")
    assert f is not None, [x.rule for x in result.findings]
    return f.evidence["unreadable"]


@pytest.mark.parametrize("text, says", [
    ("[]", "holds a list where a JSON object belongs"),
    ("[" * 100_000 + "]" * 100_000, "nested 100000 deep"),
    ('{"log_history": {"step": 1}}', '"log_history" holds an object where a list belongs'),
    ('{"log_history": [{"step": "x", "learning_rate": 1}]}', "not a number"),
    ('{"max_steps": "many"}', '"max_steps" holds a string'),
])
def test_a_malformed_trainer_state_is_named(tmp_path, checkpoint, text, says):
    (checkpoint / "trainer_state.json").write_text(text)
    assert says in _unreadable(tmp_path, checkpoint)["trainer_state.json"]


def test_an_index_whose_weight_map_is_a_list_is_named(tmp_path, checkpoint):
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["model.safetensors"]}))
    assert '"weight_map" holds a list' in _unreadable(tmp_path, checkpoint)["model.safetensors.index.json"]


def test_an_index_naming_a_shard_outside_the_folder_is_named(tmp_path, checkpoint):
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "../../etc/passwd"}}))
    assert "outside the checkpoint folder" in _unreadable(tmp_path, checkpoint)["model.safetensors.index.json"]


def test_a_safetensors_header_length_of_2_62_is_named(tmp_path, checkpoint):
    path = checkpoint / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[:8] = struct.pack("<Q", 2 ** 62)
    path.write_bytes(bytes(data))
    assert "over the limit" in _unreadable(tmp_path, checkpoint)["model.safetensors"]


def test_fifos_in_a_checkpoint_are_refused_not_waited_on(tmp_path, checkpoint):
    for name in ("trainer_state.json", "optimizer.pt", "training_args.bin"):
        os.remove(checkpoint / name)
        os.mkfifo(checkpoint / name)
    unreadable = _unreadable(tmp_path, checkpoint)
    assert {n: "FIFO" in unreadable.get(n, "") for n in ("trainer_state.json", "optimizer.pt", "training_args.bin")} \
        == dict.fromkeys(("trainer_state.json", "optimizer.pt", "training_args.bin"), True)


def test_a_folder_of_20000_files_keeps_a_bounded_list_of_names(tmp_path, checkpoint):
    os.remove(checkpoint / "optimizer.pt")  # a finding whose evidence lists the folder
    for i in range(20_000):
        (checkpoint / f"extra-{i:05d}.txt").touch()
    result = nbguard.audit(trainer=_trainer(tmp_path / "new"), resume_from_checkpoint=str(checkpoint))
    f = result.finding("resume-checkpoint-incomplete")
    assert f is not None and len(f.evidence["files"]) <= 200
    assert len(json.dumps(result.to_document())) < 200_000


# ---- export checks -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trained_adapter(tmp_path_factory):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    tmp = tmp_path_factory.mktemp("export")
    tiny_llama().save_pretrained(tmp / "base")
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(str(tmp / "base")),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(0))
    return model


def _export_error(model, folder) -> str:
    result = _finishes(lambda: nbguard.check_export(model, str(folder)),
                       fifo=str(folder / "adapter_config.json"))
    f = result.finding("export-reload-fails")
    assert f is not None, [x.rule for x in result.findings]
    return f.evidence["error"]


def test_an_adapter_config_that_is_a_list_is_named(trained_adapter, tmp_path):
    trained_adapter.save_pretrained(tmp_path / "a")
    (tmp_path / "a" / "adapter_config.json").write_text("[]")
    assert "adapter_config.json: holds a list where a JSON object belongs" in _export_error(trained_adapter, tmp_path / "a")


def test_an_adapter_file_with_a_2_62_header_length_is_named(trained_adapter, tmp_path):
    trained_adapter.save_pretrained(tmp_path / "a")
    path = tmp_path / "a" / "adapter_model.safetensors"
    data = bytearray(path.read_bytes())
    data[:8] = struct.pack("<Q", 2 ** 62)
    path.write_bytes(bytes(data))
    assert _export_error(trained_adapter, tmp_path / "a")
    result = nbguard.check_export(trained_adapter, str(tmp_path / "a"))
    assert "over the limit" in result.facts.saved["error"]


def test_a_pickled_adapter_bin_weights_only_refuses_is_named(trained_adapter, tmp_path):
    trained_adapter.save_pretrained(tmp_path / "a")
    os.remove(tmp_path / "a" / "adapter_model.safetensors")
    (tmp_path / "a" / "adapter_model.bin").write_bytes(pickle.dumps({"x": argparse.Namespace(a=1)}))
    assert _export_error(trained_adapter, tmp_path / "a")
    saved = nbguard.check_export(trained_adapter, str(tmp_path / "a")).facts.saved
    assert saved["file"] == "adapter_model.bin" and "error" in saved


def test_an_adapter_config_that_is_a_fifo_does_not_hang(trained_adapter, tmp_path):
    trained_adapter.save_pretrained(tmp_path / "a")
    os.remove(tmp_path / "a" / "adapter_config.json")
    os.mkfifo(tmp_path / "a" / "adapter_config.json")
    assert "adapter_config.json is a FIFO" in _export_error(trained_adapter, tmp_path / "a")


# ---- the other readers of a model's folder ------------------------------------------------------
def test_a_saved_config_that_is_a_list_leaves_the_dtype_to_the_loaded_config(tmp_path):
    from nbguard.auditor.checkpoint import checkpoint_dtype

    model = tiny_llama(dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text("[]")
    model.config._name_or_path = str(tmp_path / "m")
    assert checkpoint_dtype(model.config) == ("bfloat16", "model.config.dtype")  # before: AttributeError


def test_checkpoint_keys_read_bounded_headers(tmp_path):
    from nbguard.auditor.rules.loading import checkpoint_keys

    tiny_llama().save_pretrained(tmp_path / "m")
    keys = checkpoint_keys(str(tmp_path / "m"))
    assert keys is not None and "model.embed_tokens.weight" in keys
    path = tmp_path / "m" / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[:8] = struct.pack("<Q", 2 ** 62)
    path.write_bytes(bytes(data))
    assert checkpoint_keys(str(tmp_path / "m")) is None  # before: SafetensorError out of the rule
