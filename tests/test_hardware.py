"""Hardware profiles, detection on this machine, and what the audit draws from them."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from nbguard.hardware import PROFILES, Hardware, detect, profile_name, resolve_hardware


def test_all_named_profiles_exist():
    assert set(PROFILES) == {"cpu", "t4", "v100", "a10g", "l4", "a100", "rtx3090", "rtx4090", "h100", "h200",
                             "b200", "rtx5090"}


@pytest.mark.parametrize("name, native", [
    ("t4", False), ("v100", False), ("a10g", True), ("l4", True), ("a100", True),
    ("rtx3090", True), ("rtx4090", True), ("h100", True), ("h200", True), ("b200", True), ("rtx5090", True),
    ("cpu", True),
])
def test_native_bf16_is_compute_capability_8(name, native):
    hw = PROFILES[name]
    assert hw.native_bf16 is native
    assert hw.best_half_precision == ("bf16" if native else "fp32")


def test_native_bf16_boundary_is_8_0():
    assert not replace(PROFILES["a100"], compute_capability=(7, 9)).native_bf16
    assert replace(PROFILES["t4"], compute_capability=(8, 0)).native_bf16
    assert not replace(PROFILES["t4"], compute_capability=None).native_bf16


def test_resolve_hardware_accepts_names_instances_and_none():
    assert resolve_hardware("T4") is PROFILES["t4"]
    assert resolve_hardware("rtx-4090") is PROFILES["rtx4090"]
    assert resolve_hardware(PROFILES["l4"]) is PROFILES["l4"]
    assert resolve_hardware(None).detected
    with pytest.raises(ValueError, match="not a known profile.*t4"):
        resolve_hardware("k80")
    with pytest.raises(TypeError, match="hardware must be a profile name"):
        resolve_hardware(75)


def test_detect_on_this_machine():
    hw = detect()
    assert hw.detected
    if not torch.cuda.is_available():
        assert hw.device_type in ("cpu", "mps") and hw.compute_capability is None
    else:  # pragma: no cover - GPU machines only
        assert hw.compute_capability == torch.cuda.get_device_capability(0)


@pytest.mark.parametrize("device_name, profile", [
    ("Tesla T4", "t4"), ("Tesla V100-SXM2-16GB", "v100"), ("NVIDIA A10G", "a10g"), ("NVIDIA L4", "l4"),
    ("NVIDIA A100-SXM4-40GB", "a100"), ("NVIDIA A100 80GB PCIe", "a100"), ("NVIDIA GeForce RTX 3090", "rtx3090"),
    ("NVIDIA GeForce RTX 3090 Ti", "rtx3090"), ("NVIDIA GeForce RTX 4090", "rtx4090"),
    ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"), ("NVIDIA B200", "b200"),
    ("NVIDIA GeForce RTX 5090", "rtx5090"), ("NVIDIA GeForce RTX 5090 D", "rtx5090"),
    # other GPUs whose names contain a profile's model number are not that GPU
    ("NVIDIA L40S", "cuda"), ("NVIDIA L40", "cuda"), ("NVIDIA GH200 480GB", "cuda"), ("NVIDIA RTX A4000", "cuda"),
    ("NVIDIA GB200", "cuda"),
])
def test_profile_is_named_by_the_whole_model_number(device_name, profile):
    assert profile_name(device_name) == profile


def test_to_dict_is_json_and_says_native_bf16():
    data = PROFILES["t4"].to_dict()
    json.dumps(data)
    assert data["compute_capability"] == [7, 5] and data["native_bf16"] is False
    assert Hardware(**{k: v for k, v in data.items() if k != "native_bf16"} | {"compute_capability": (7, 5)}) == \
        PROFILES["t4"]


def test_audit_result_carries_the_hardware():
    import nbguard
    from nbguard.testing import tiny_llama

    result = nbguard.audit(tiny_llama(), hardware="l4")
    assert result.hardware is PROFILES["l4"]
    assert result.to_document()["hardware"]["name"] == "l4"
