"""The precision a training step runs in: autocast regions as captured, re-entered, or as a Trainer sets them.

A Trainer does not call ``torch.autocast`` itself: accelerate enters it from the args' mixed precision,
and only where the device runs it (fp16 autocast needs a GPU; on CPU ``fp16=True`` trains in fp32).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

AutocastRegions = list[tuple[str, torch.dtype]]  # (device type, dtype) for every autocast region entered


class PrecisionUnavailable(Exception):
    """This machine cannot run the precision asked for; the message says why."""


def autocast_devices() -> tuple[str, ...]:
    return ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)


def capture_autocast() -> AutocastRegions:
    """The autocast regions active around this forward, to re-enter them in a replay.

    Runs at every training micro-batch: the flags are read first, and whether CUDA is available only
    where CUDA autocast is on (the same regions as ``autocast_devices()`` gives, without asking the
    driver each time)."""
    try:
        active = []
        for device in ("cpu", "cuda"):
            if torch.is_autocast_enabled(device) and (device == "cpu" or torch.cuda.is_available()):
                active.append((device, torch.get_autocast_dtype(device)))
        return active
    except (RuntimeError, TypeError, AttributeError):  # torch < 2.4 has per-device functions
        return _capture_autocast_per_device()


def _capture_autocast_per_device() -> AutocastRegions:
    active = []
    for device in autocast_devices():
        try:
            if torch.is_autocast_enabled(device):
                active.append((device, torch.get_autocast_dtype(device)))
        except (RuntimeError, TypeError, AttributeError):  # torch < 2.4 has per-device functions
            if device == "cpu" and torch.is_autocast_cpu_enabled():
                active.append(("cpu", torch.get_autocast_cpu_dtype()))
            elif device == "cuda" and torch.is_autocast_enabled():
                active.append(("cuda", torch.get_autocast_gpu_dtype()))
    return active


@contextlib.contextmanager
def autocast_as(active: AutocastRegions) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for device in autocast_devices():  # leave autocast the caller may have on exactly as captured
            dtype = dict(active).get(device)
            if dtype is not None:
                stack.enter_context(torch.autocast(device, dtype=dtype))
            else:
                stack.enter_context(torch.autocast(device, enabled=False))
        yield


def autocast_text(regions: AutocastRegions) -> str:
    if not regions:
        return "no autocast"
    return ", ".join(f"autocast {d} {str(t).replace('torch.', '')}" for d, t in regions)


def args_mixed_precision(args: Any) -> str:
    """"bf16", "fp16" or "no": what TrainingArguments ask accelerate for."""
    if getattr(args, "bf16", False):
        return "bf16"
    return "fp16" if getattr(args, "fp16", False) else "no"


def trainer_autocast(mixed_precision: str, device_type: str) -> AutocastRegions:
    """The autocast a Trainer's accelerator enters for ``mixed_precision`` on ``device_type``.

    As accelerate decides it: bf16 autocast on CPU (and on GPUs with bf16), fp16 autocast only on a
    GPU (on CPU, fp16=True leaves the step in fp32), none for "no". Raises ``PrecisionUnavailable``
    where the Trainer would refuse the flag on this machine.
    """
    if mixed_precision == "bf16":
        if device_type == "cuda" and not (torch.cuda.is_available() and
                                          torch.cuda.is_bf16_supported(including_emulation=False)):
            gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
            raise PrecisionUnavailable(f"this machine's GPU ({gpu}) has no native bf16: a Trainer with bf16=True "
                                       "refuses to run here")
        return [(device_type, torch.bfloat16)]
    if mixed_precision == "fp16":
        return [] if device_type == "cpu" else [(device_type, torch.float16)]
    if mixed_precision == "no":
        return []
    raise ValueError(f"mixed_precision must be 'bf16', 'fp16' or 'no'; got {mixed_precision!r}")
