"""Will the run fit the GPU in a given precision? A static estimate from the parameters alone.

Counted: the weights (quantised storage as stored, other floating weights in the precision asked
for), the gradients and AdamW's two moments of the trainable parameters, and a fixed reserve for
the CUDA context and allocator. Not counted: activations, which depend on batch size, sequence
length and checkpointing; the estimate is a floor, so "does not fit" is certain and "fits" says
there is at least that much left for activations.

Works on meta-device models (shapes only), so an 8B model can be estimated without its memory.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from ..hardware import PROFILES, Hardware

GIB = 2 ** 30
RESERVE_BYTES = 1 * GIB  # CUDA context + allocator slack, measured ~0.5-1 GiB on T4/A100
USABLE_FRACTION = 0.9  # the allocator never hands out the last few percent
PRECISIONS = ("as-is", "fp32", "bf16")
_QUANTIZED = ("Params4bit", "Int8Params")


def _quantized_bytes(p: torch.nn.Parameter) -> int:
    """Stored bytes of a bitsandbytes parameter plus its quantisation scales (absmax)."""
    total = p.numel() * p.element_size()
    absmax = getattr(getattr(p, "quant_state", None), "absmax", None)
    if isinstance(absmax, torch.Tensor):
        total += absmax.numel() * absmax.element_size()
    return total


def _logical_numel(p: torch.nn.Parameter) -> int:
    shape = getattr(getattr(p, "quant_state", None), "shape", None)
    return int(torch.Size(shape).numel()) if shape is not None else p.numel()


def _stored_size(p: torch.nn.Parameter, precision: str) -> int:
    """Bytes per value of a non-quantised floating parameter after switching to ``precision``
    the way switch-precision does (trainable weights always float32 in fp32 and bf16)."""
    if precision == "as-is":
        return p.element_size()
    if precision == "fp32" or p.requires_grad:
        return 4
    return 2 if p.element_size() <= 2 else 4  # bf16: frozen half weights stay 2 bytes, fp32 ones stay fp32


@dataclass
class MemoryEstimate:
    precision: str
    parameters: int  # logical parameter count (4-bit weights counted unpacked)
    trainable: int
    weights_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    reserve_bytes: int = RESERVE_BYTES

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.grads_bytes + self.optimizer_bytes + self.reserve_bytes

    @property
    def total_gb(self) -> float:
        return self.total_bytes / GIB

    def fits(self, memory_gb: float | None) -> bool | None:
        """None when the device's memory is unknown (CPU, an unknown GPU)."""
        if memory_gb is None:
            return None
        return self.total_bytes <= memory_gb * GIB * USABLE_FRACTION

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["total_gb"] = round(self.total_gb, 2)
        return data


def estimate_memory(model: torch.nn.Module, precision: str = "as-is", optimizer_bytes_per_value: int = 8,
                    fp32_modules: set[str] | None = None,
                    params: list[torch.nn.Parameter] | None = None) -> MemoryEstimate:
    """Weights + gradients + optimizer state for training ``model`` in ``precision``.

    ``optimizer_bytes_per_value``: 8 for AdamW with fp32 moments, 2 for bitsandbytes 8-bit AdamW.
    ``fp32_modules``: with ``precision="as-is"``, these modules' weights counted in float32 (the
    partial switch that keeps the rest of the model as it is).
    ``params``: ``model.parameters()`` already listed (the audit walks a big model once).
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}; got {precision!r}")
    in_fp32: set[int] = set()
    for name in fp32_modules or ():
        in_fp32 |= {id(p) for p in model.get_submodule(name).parameters()}
    count, trainable, weights, grads = 0, 0, 0, 0
    seen: set[int] = set()
    for p in params if params is not None else model.parameters():
        if id(p) in seen:  # tied weights once
            continue
        seen.add(id(p))
        count += _logical_numel(p)
        if type(p).__name__ in _QUANTIZED or not p.is_floating_point():
            weights += _quantized_bytes(p)
            continue
        size = 4 if id(p) in in_fp32 else _stored_size(p, precision)
        weights += p.numel() * size
        if p.requires_grad:
            trainable += p.numel()
            grads += p.numel() * size
    return MemoryEstimate(precision, count, trainable, weights, grads, trainable * optimizer_bytes_per_value)


def bf16_gpus_that_fit(model: torch.nn.Module, optimizer_bytes_per_value: int = 8,
                       params: list[torch.nn.Parameter] | None = None) -> list[str]:
    """Named GPU profiles with native bf16 where the bf16 switch fits, smallest memory first."""
    estimate = estimate_memory(model, "bf16", optimizer_bytes_per_value, params=params)
    fitting: list[Hardware] = [hw for hw in PROFILES.values()
                               if hw.device_type == "cuda" and hw.native_bf16 and estimate.fits(hw.memory_gb)]
    return [hw.name for hw in sorted(fitting, key=lambda hw: hw.memory_gb or 0)]
