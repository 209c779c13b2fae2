"""Issue 34 item 5: a GPU the installed torch or a CUDA extension has no kernels for (Blackwell on a
CUDA 12.6 torch, a V100 on a CUDA 12.9 torch), read from the builds' real architecture lists.

This machine has no GPU and a CPU torch: the GPU is a hardware profile, torch's side is the arch
list a target's torch reports (``torch.cuda.get_arch_list()`` there), and the extension side is read
from the bitsandbytes CUDA libraries really installed here (their ``.nv_fatbin`` sections)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import nbguard
from nbguard.auditor.context import AuditContext
from nbguard.auditor.registry import RULES
from nbguard.hardware import PROFILES
from nbguard.introspect.cuda_archs import (
    KernelCode,
    bitsandbytes_library,
    fatbin_codes,
    parse_arch_flag,
    read_cuda_build,
)
from nbguard.testing import tiny_4bit, tiny_llama

torch.set_num_threads(1)

# what torch.cuda.get_arch_list() reports in the x86 release wheels (torch's PYTORCH_RELEASES_CODE_CC table)
CU126 = ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"]
CU128 = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]


def _check(model, hardware: str, **torch_build):
    ctx = AuditContext(model=model, hardware=PROFILES[hardware])
    ctx.cuda_build = read_cuda_build(**torch_build)
    return RULES["cuda-arch-not-built"].check(ctx)


def _bnb(version: str) -> Path:
    path = bitsandbytes_library(version)
    assert path is not None and path.exists(), path
    return path


def test_the_architectures_are_read_from_the_installed_bitsandbytes_libraries():
    old, blackwell = fatbin_codes(_bnb("11.8")), fatbin_codes(_bnb("12.8"))
    assert KernelCode(90) in old and KernelCode(120) not in old and KernelCode(100) not in old
    assert {KernelCode(100), KernelCode(120)} <= set(blackwell)
    assert KernelCode(70) not in fatbin_codes(_bnb("13.0"))  # CUDA 13 dropped Volta
    assert fatbin_codes(_bnb("12.8").with_name("libbitsandbytes_cpu.so")) == ()  # a CPU library carries none
    with pytest.raises(ValueError, match="not a 64-bit little-endian ELF"):
        fatbin_codes(Path(nbguard.__file__))


@pytest.mark.parametrize("code, capability, runs", [
    ("sm_86", (8, 9), True), ("sm_89", (8, 6), False), ("sm_90", (12, 0), False), ("compute_90", (12, 0), True),
    ("sm_90a", (9, 0), True), ("sm_90a", (10, 0), False), ("sm_120", (12, 1), True), ("sm_100", (12, 0), False),
    ("sm_70", (7, 5), True), ("sm_75", (7, 0), False),
])
def test_a_cubin_runs_within_its_family_and_ptx_on_anything_newer(code, capability, runs):
    assert parse_arch_flag(code).runs_on(capability) is runs


def test_a_bad_arch_flag_is_refused_by_name():
    with pytest.raises(ValueError, match="'blackwell' is not a CUDA architecture flag"):
        parse_arch_flag("blackwell")
    with pytest.raises(ValueError, match="all three of torch_version, torch_cuda and torch_arch_list"):
        read_cuda_build(torch_cuda="12.8")


def test_a_cuda_12_6_torch_on_an_rtx_5090_is_an_error_naming_sm_120_and_the_build_to_install():
    found = _check(tiny_llama(), "rtx5090", torch_version="2.6.0+cu126", torch_cuda="12.6", torch_arch_list=CU126)
    assert found is not None and found.severity.value == "error"
    assert "sm_120" in found.title and "RTX 5090" in found.title
    assert "sm_50 sm_60 sm_70 sm_75 sm_80 sm_86 sm_90 and none for sm_120" in found.detail
    assert "no kernel image is available" in found.detail
    assert "pip install torch --index-url https://download.pytorch.org/whl/cu128." in found.detail
    assert found.evidence["torch_arch_list"] == CU126
    assert "bitsandbytes_archs" not in found.evidence  # a model without 4-bit layers loads no bitsandbytes


@pytest.mark.parametrize("hardware", ["rtx5090", "b200", "h100", "t4"])
def test_a_cuda_12_8_torch_carries_every_one_of_these_gpus(hardware):
    assert _check(tiny_llama(), hardware, torch_version="2.7.0+cu128", torch_cuda="12.8",
                  torch_arch_list=CU128) is None


def test_a_v100_gets_no_kernels_from_a_torch_for_cuda_12_8_and_is_sent_back_to_12_6():
    release = torch.__version__.split("+")[0]  # torch's own table describes the builds of its own release
    found = _check(tiny_llama(), "v100", torch_version=f"{release}+cu128", torch_cuda="12.8", torch_arch_list=CU128)
    assert found is not None and "none for sm_70" in found.detail
    assert isinstance(torch.cuda.PYTORCH_RELEASES_CODE_CC, dict)  # torch 2.13 ships it: the remedy names the build
    assert f"(12.6), e.g. pip install torch=={release} --index-url https://download.pytorch.org/whl/cu126." in found.detail
    # the same build on a Blackwell GPU is sent to the oldest CUDA whose builds carry sm_120
    found = _check(tiny_llama(), "rtx5090", torch_version=f"{release}+cu126", torch_cuda="12.6", torch_arch_list=CU126)
    assert f"pip install torch=={release} --index-url https://download.pytorch.org/whl/cu129." in found.detail


def test_a_4bit_model_on_blackwell_needs_bitsandbytes_kernels_for_it_too():
    model = tiny_4bit()
    found = _check(model, "rtx5090", torch_version="2.6.0+cu126", torch_cuda="12.6", torch_arch_list=CU126)
    assert found is not None and "2 installed build(s)" in found.title
    assert found.evidence["bitsandbytes_library"] == str(_bnb("12.6"))
    assert "sm_120" not in found.evidence["bitsandbytes_archs"] and "sm_90" in found.evidence["bitsandbytes_archs"]
    assert "libbitsandbytes_cuda126.so carries kernels for" in found.detail
    # the same model with a CUDA 12.8 torch loads libbitsandbytes_cuda128.so, which carries sm_120: quiet
    assert _check(model, "rtx5090", torch_version="2.7.0+cu128", torch_cuda="12.8", torch_arch_list=CU128) is None


def test_a_torch_cuda_version_bitsandbytes_has_no_library_for_is_named():
    found = _check(tiny_4bit(), "rtx5090", torch_version="2.99.0+cu199", torch_cuda="19.9",
                   torch_arch_list=CU128)
    assert found is not None and found.evidence["bitsandbytes_missing_library"] == "libbitsandbytes_cuda199.so"
    assert "loads without GPU support" in found.detail and "torch_arch_list" not in found.evidence


def test_a_cpu_torch_here_says_nothing_about_a_target_gpu():
    assert torch.version.cuda is None  # this machine's torch is the CPU build
    result = nbguard.audit(tiny_4bit(), hardware="rtx5090")
    assert "cuda-arch-not-built" not in {f.rule for f in result.findings}
    assert read_cuda_build().torch_codes == ()


# ---- the explainer: torch's own warning text, and the CUDA runtime's error -------------------------------

def _torch_startup_warnings(monkeypatch, device_name: str, capability: tuple[int, int], arch_list: list[str]):
    """The warnings torch.cuda's own start-up checks write for this GPU and build (their real text, from the
    installed torch's code; only the device queries are answered for a GPU this machine does not have)."""
    import warnings

    monkeypatch.setattr(torch.version, "cuda", "12.6")
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: arch_list)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: device_name)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda._check_cubins()
        torch.cuda._check_capability()
    return [str(w.message) for w in caught]


def test_torchs_own_start_up_warnings_on_an_rtx_5090_are_explained(monkeypatch):
    from nbguard.explainer.warnings import diagnose_warning

    texts = _torch_startup_warnings(monkeypatch, "NVIDIA GeForce RTX 5090", (12, 0), CU126)
    assert len(texts) == 2  # the old-style and the new-style check both fire on this torch
    diagnoses = [diagnose_warning(text, "UserWarning") for text in texts]
    assert all(d is not None and d.signature == "cuda-arch-not-compatible" for d in diagnoses)
    assert all("NVIDIA GeForce RTX 5090 (sm_120)" in d.title for d in diagnoses)
    old, new = diagnoses
    assert old.evidence["torch_arch_list"] == CU126
    # the new-style text names the builds to install; the explanation passes on the first one verbatim
    assert new.evidence["install"] and new.evidence["install"][0] in new.detail
    assert new.evidence["install"][0].startswith("pip install torch==") and "/cu12" in new.evidence["install"][0]


def test_a_gpu_the_build_carries_raises_no_warning_and_other_warnings_are_not_taken(monkeypatch):
    from nbguard.explainer.warnings import diagnose_warning

    assert _torch_startup_warnings(monkeypatch, "NVIDIA H100 80GB HBM3", (9, 0), CU126) == []
    assert diagnose_warning("sm_120 is fine on this machine", "UserWarning") is None


CUDA_NO_KERNEL = ("CUDA error: no kernel image is available for execution on the device\n"
                  "CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace "
                  "below might be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1\n"
                  "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.\n")


def test_no_kernel_image_from_a_4bit_forward_names_bitsandbytes(monkeypatch):
    """A real 4-bit forward through bitsandbytes' own code, its kernel call answering as the CUDA runtime does
    on a GPU the library was not built for."""
    import bitsandbytes.backends.cpu.ops

    def no_kernel(*args, **kwargs):
        raise RuntimeError(CUDA_NO_KERNEL)

    model = tiny_4bit()
    # the step before bitsandbytes' compiled 4-bit kernel runs: where a GPU build's launch fails
    monkeypatch.setattr(bitsandbytes.backends.cpu.ops, "get_ptr", no_kernel)
    with pytest.raises(RuntimeError) as raised:
        model(input_ids=torch.tensor([[1, 2, 3]]))
    diagnosis = nbguard.explain(raised.value)
    assert diagnosis is not None and diagnosis.signature == "cuda-no-kernel-image"
    assert diagnosis.title == "no CUDA kernels for this GPU in bitsandbytes"
    assert diagnosis.evidence["raised_in"] == "bitsandbytes" and "bitsandbytes >= 0.45.3" in diagnosis.detail
    assert "gpu" not in diagnosis.evidence  # this machine has no GPU: no facts are made up for one


def test_no_kernel_image_from_torch_itself_names_torch():
    diagnosis = nbguard.explain(RuntimeError(CUDA_NO_KERNEL))
    assert diagnosis is not None and diagnosis.title == "no CUDA kernels for this GPU in torch"
    assert diagnosis.evidence == {"raised_in": "torch"}
    assert getattr(nbguard.explain(RuntimeError("CUDA error: out of memory")), "signature", None) != "cuda-no-kernel-image"


def test_the_scan_skips_padding_to_the_next_aligned_container():
    import io
    import struct

    from nbguard.introspect.cuda_archs import _next_magic

    magic = struct.pack("<I", 0xBA55ED50)
    data = bytes(20) + magic + bytes(8) + magic + bytes(16)  # the first copy sits at 20: not 8-byte aligned
    assert _next_magic(io.BytesIO(data), 8, len(data)) == 32
    assert _next_magic(io.BytesIO(data), 8, len(data), chunk=8) == 32  # found across chunk edges too
    assert _next_magic(io.BytesIO(data), 36, len(data)) == len(data)
    assert _next_magic(io.BytesIO(bytes(64)), 0, 64) == 64
