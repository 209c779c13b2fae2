"""Issue 43 item 6: the export check names a saved adapter's zero-element and all-zero tensors (ZeRO-3 saves
without a gather: trl#4416, peft#2892).

No DeepSpeed run here. What is reproduced on the CPU is ZeRO-3's mechanism: outside a gather each parameter's
``.data`` is a zero-element placeholder, so ``save_pretrained`` on that model writes ``shape [0]`` tensors; and
a save whose lora_A came back as zeros. The trained model is a real PEFT LoRA on a tiny Llama trained by a real
Trainer; each broken folder is written by PEFT's own ``save_pretrained``.
"""
from __future__ import annotations

import copy

import pytest
import torch
from test_export_check import load_base, lora, train

import nbguard
import nbguard.fixes

pytestmark = pytest.mark.filterwarnings("ignore")


def saved_as_zero3_leaves_it(model, path, hollow) -> None:
    """Save a copy of ``model`` whose LoRA parameters ``hollow`` changed (the trained model stays whole)."""
    copied = copy.deepcopy(model)
    for name, p in copied.named_parameters():
        if "lora_" in name:
            hollow(name, p)
    copied.save_pretrained(path)


def empty(name, p) -> None:
    p.data = torch.empty(0, dtype=p.dtype)  # what ZeRO-3 leaves in a parameter outside a gather


def zero_lora_a(name, p) -> None:
    if "lora_A" in name:
        p.data.zero_()


def test_a_zero3_style_empty_save_is_named_tensor_by_tensor_and_the_resave_is_quiet(tmp_path):
    model = lora(load_base(tmp_path))
    train(model, tmp_path)
    folder = str(tmp_path / "adapter")
    saved_as_zero3_leaves_it(model, folder, empty)
    result = nbguard.check_export(model, folder)
    f = result.finding("export-empty-tensors")
    assert f is not None and f.severity.value == "error" and f.fixes == ["resave-adapter"]
    assert f.evidence["empty_count"] == f.evidence["tensors"] == 8  # lora_A and lora_B of 2 targets x 2 layers
    assert all(shape == [0] for shape in f.evidence["empty"].values())
    assert any(".lora_A." in k for k in f.evidence["empty"]) and "[0]" in f.detail and "ZeRO-3" in f.detail
    # the fix applied (the trained model saved again): quiet
    nbguard.fixes.apply("resave-adapter", model=model, path=folder)
    assert nbguard.check_export(model, folder).findings == []


def test_a_save_whose_lora_a_came_back_as_zeros_is_named_and_says_so(tmp_path):
    model = lora(load_base(tmp_path))
    train(model, tmp_path)
    folder = str(tmp_path / "adapter")
    saved_as_zero3_leaves_it(model, folder, zero_lora_a)
    result = nbguard.check_export(model, folder)
    f = result.finding("export-empty-tensors")
    assert f is not None and f.evidence["empty_count"] == 0 and f.evidence["all_zero_count"] == 4
    assert all(".lora_A." in k for k in f.evidence["all_zero"]) and "all zeros" in f.detail
    dead = result.finding("export-adapter-no-effect")  # reloaded, it is the base model: said with the same cause
    assert dead is not None and "lora_A" in dead.detail and "did not load" not in dead.detail
    model.save_pretrained(folder)
    assert nbguard.check_export(model, folder).findings == []
