"""The machine a run will train on: detection, and named profiles to audit against.

"Would this run on a Colab T4?" is ``resolve_hardware("t4")``. Native bf16 means compute
capability >= 8.0: ``torch.cuda.is_bf16_supported()`` answers True on a T4 too, because it
counts emulation, which is slow and is not what mixed-precision training expects.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, replace

NATIVE_BF16_MIN_CAPABILITY = (8, 0)


@dataclass(frozen=True)
class Hardware:
    name: str  # profile id ("t4", "cpu", ...) or "cuda" for an unknown GPU
    display_name: str
    device_type: str  # "cuda", "cpu" or "mps"
    compute_capability: tuple[int, int] | None = None
    memory_gb: float | None = None
    detected: bool = False  # True when read off this machine rather than taken from a profile

    @property
    def native_bf16(self) -> bool:
        if self.device_type == "cuda":
            return self.compute_capability is not None and self.compute_capability >= NATIVE_BF16_MIN_CAPABILITY
        return True  # CPU and Apple MPS run bf16 as a real type (no fp16-style range issues)

    @property
    def is_gpu(self) -> bool:
        return self.device_type in ("cuda", "mps")

    @property
    def best_half_precision(self) -> str:
        """The training precision to recommend when fp16 is unsafe: bf16 where native, else fp32."""
        return "bf16" if self.native_bf16 else "fp32"

    def to_dict(self) -> dict:
        data = asdict(self)
        data["compute_capability"] = list(self.compute_capability) if self.compute_capability else None
        data["native_bf16"] = self.native_bf16
        return data


def _gpu(name: str, display: str, cc: tuple[int, int], gb: float) -> Hardware:
    return Hardware(name=name, display_name=display, device_type="cuda", compute_capability=cc, memory_gb=gb)


PROFILES: dict[str, Hardware] = {
    "cpu": Hardware(name="cpu", display_name="CPU", device_type="cpu"),
    "t4": _gpu("t4", "NVIDIA Tesla T4", (7, 5), 15.0),
    "v100": _gpu("v100", "NVIDIA Tesla V100", (7, 0), 16.0),
    "a10g": _gpu("a10g", "NVIDIA A10G", (8, 6), 24.0),
    "l4": _gpu("l4", "NVIDIA L4", (8, 9), 22.5),
    "a100": _gpu("a100", "NVIDIA A100", (8, 0), 40.0),
    "rtx3090": _gpu("rtx3090", "NVIDIA GeForce RTX 3090", (8, 6), 24.0),
    "rtx4090": _gpu("rtx4090", "NVIDIA GeForce RTX 4090", (8, 9), 24.0),
    "h100": _gpu("h100", "NVIDIA H100", (9, 0), 80.0),
    "h200": _gpu("h200", "NVIDIA H200", (9, 0), 141.0),
    # Blackwell: data-centre sm_100 and consumer sm_120 need builds made with CUDA 12.8 or newer
    "b200": _gpu("b200", "NVIDIA B200", (10, 0), 180.0),
    "rtx5090": _gpu("rtx5090", "NVIDIA GeForce RTX 5090", (12, 0), 32.0),
}

# Model numbers in torch.cuda.get_device_name() that identify a profile, as whole words: "NVIDIA L40S"
# is not an L4, nor "NVIDIA GH200 480GB" an H200 ("Tesla V100-SXM2-16GB" is a V100)
_NAME_HINTS = (
    ("T4", "t4"), ("V100", "v100"), ("A10G", "a10g"), ("L4", "l4"), ("A100", "a100"),
    ("3090", "rtx3090"), ("4090", "rtx4090"), ("H100", "h100"), ("H200", "h200"), ("B200", "b200"),
    ("5090", "rtx5090"),
)
_WORDS = re.compile(r"[A-Za-z0-9]+")


def profile_name(device_name: str) -> str:
    """The profile id for a CUDA device name (``torch.cuda.get_device_name()``), or "cuda" for none."""
    words = set(_WORDS.findall(device_name))
    return next((pid for hint, pid in _NAME_HINTS if hint in words), "cuda")


def detect() -> Hardware:
    """The device this process would train on (first CUDA device, else MPS, else CPU)."""
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return Hardware(
            name=profile_name(props.name),
            display_name=props.name,
            device_type="cuda",
            compute_capability=(props.major, props.minor),
            memory_gb=round(props.total_memory / 2**30, 1),
            detected=True,
        )
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return Hardware(name="mps", display_name="Apple MPS", device_type="mps", detected=True)
    return replace(PROFILES["cpu"], detected=True)


def resolve_hardware(spec: str | Hardware | None = None) -> Hardware:
    """A :class:`Hardware` from a profile name, an instance, or None (detect this machine)."""
    if spec is None:
        return detect()
    if isinstance(spec, Hardware):
        return spec
    if isinstance(spec, str):
        key = spec.strip().lower().replace("-", "").replace(" ", "")
        if key in PROFILES:
            return PROFILES[key]
        raise ValueError(f"hardware={spec!r} is not a known profile; use one of {', '.join(PROFILES)} or None to detect")
    raise TypeError(f"hardware must be a profile name such as 't4', a Hardware, or None; got {type(spec).__name__}")
