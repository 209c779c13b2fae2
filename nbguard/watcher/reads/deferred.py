"""Statistics read one step late (``WatchSettings(read="deferred")``, issue 45).

The host read of the step's numbers (``sentinel``) makes the CPU wait for the device every step: the
CPU may not let the optimizer update until it has the verdict. Here the verdict stays on the device:

- ``finite_flag``: whether the step's norms and loss are finite, a 0-d tensor (no host read);
- ``DeviceSkip``: torch's fused Adam, AdamW and SGD skip their update when ``optimizer.found_inf`` is
  non-zero (the contract GradScaler uses), so a non-finite update is dropped on the device, moments
  and step count untouched; so is an exploded one (a divergence: the detectors' bounds, set by the steps
  judged so far, compared on the device: ``WatchComponent.drops_on_device``);
- ``HostMirror``: the step's gathered numbers are copied into a host buffer without waiting
  (pinned memory, ``non_blocking``, an event recorded after the copy) and read at the next step,
  when the copy has long landed. Events, localisation, detectors and trackers run one step late;
  that is safe where the bad update never happened.

``unavailable`` says where this cannot hold (the watch then reads on the host, and says so).
"""
from __future__ import annotations

from typing import Any

import torch

# policies that drop a bad update: deferred, that needs the optimizer's own device skip
_DROPPING = ("skip", "stop", "rewind")


def supports_device_skip(optimizer: Any) -> bool:
    """torch's fused optimizers read ``found_inf`` and skip on the device (``_step_supports_amp_scaling``)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def unavailable(*, policy: str, optimizer: Any, per_parameter: bool, scaler: bool, activations: bool) -> str | None:
    """Why statistics cannot be read a step late for this run (None: they can). Across ranks (DDP) they can:
    the step's exchange is a collective on the device, its flags decide every rank's device skip alike, and the
    ranks read it a step late at the same point, before their next exchange (a rank that stepped aside is
    known before anyone joins another)."""
    if per_parameter:  # (FSDP2's own-gradient reader keeps per-step state the next backward would overwrite)
        return ("the gradients are read with a hook per parameter, as under FSDP2, DeepSpeed, or DDP with a "
                "communication hook of your own")
    if scaler:
        return "an enabled GradScaler decides the skip (it reads its own flag)"
    if activations:
        return "activations=True records the forward's values per step"
    if optimizer is None:
        return "no optimizer is bound yet"
    if policy in _DROPPING and not supports_device_skip(optimizer):
        return (f"policy {policy!r} must drop a bad update before the optimizer moves, and "
                f"{type(optimizer).__name__} has no device-side skip (torch's Adam, AdamW and SGD with fused=True do)")
    if policy in _DROPPING and (hasattr(optimizer, "found_inf") or hasattr(optimizer, "grad_scale")):
        return "the optimizer already carries found_inf/grad_scale (another scaler drives it)"
    return None


def finite_flag(vector: torch.Tensor, n_checked: int) -> torch.Tensor:
    """1.0 where the first ``n_checked`` values (norms and loss) are all finite, else 0.0: on the device."""
    return torch.isfinite(vector[:n_checked]).all().float()


class DeviceSkip:
    """Arms a fused optimizer's ``found_inf`` for one step: a non-finite step's update is skipped on the device."""

    def __init__(self) -> None:
        self._armed: Any = None

    def arm(self, optimizer: Any, finite: torch.Tensor, exploded: torch.Tensor | None = None) -> None:
        """``exploded``: a device flag for a finite update a detector drops (a divergence): skipped alike."""
        self.disarm()
        optimizer.grad_scale = None
        found_inf = 1.0 - finite  # what GradScaler hands fused steps: non-zero skips
        optimizer.found_inf = found_inf if exploded is None else torch.maximum(found_inf, exploded.float())
        self._armed = optimizer

    def disarm(self) -> None:
        optimizer, self._armed = self._armed, None
        if optimizer is not None:
            for name in ("grad_scale", "found_inf"):
                if name in vars(optimizer):
                    delattr(optimizer, name)


class HostMirror:
    """A host buffer filled from the device without waiting; ``values()`` reads it once the copy landed."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None
        self._event: Any = None
        self._size = 0
        self.carries_verdict = False  # the last start copied a device verdict after the vector

    def start(self, vector: torch.Tensor, verdict: torch.Tensor | None = None) -> None:
        """``verdict``: a 0-d device flag copied after the vector (``values()`` ends with it)."""
        size = vector.numel() + (verdict is not None)
        buffer = self._buffer
        if buffer is None or buffer.numel() < size:
            # pinned where the vector is on a GPU: only then does a non_blocking copy not wait
            buffer = self._buffer = torch.empty(max(size, 16), dtype=torch.float32,
                                                pin_memory=vector.is_cuda)
        buffer[:vector.numel()].copy_(vector, non_blocking=True)
        if verdict is not None:
            buffer[size - 1:size].copy_(verdict.reshape(1), non_blocking=True)
        self._size = size
        self.carries_verdict = verdict is not None
        if vector.is_cuda:
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._event = None

    def values(self) -> list[float]:
        """The copied values: a step later the copy has landed; at a flush (the loop ended) this waits for it."""
        if self._event is not None:
            if not self._event.query():  # (a query does not wait: the healthy path never synchronizes)
                self._event.synchronize()
            self._event = None
        assert self._buffer is not None
        return self._buffer[:self._size].tolist()

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is (a view of) this mirror's host memory (tests tell its reads from a sync)."""
        return self._buffer is not None and tensor.untyped_storage().data_ptr() == \
            self._buffer.untyped_storage().data_ptr()


class ParkedStep:
    """A step whose optimizer has moved and whose numbers are still on their way to the host: what its
    late judgement needs (its micro-batches for the replay, its losses, how its read is laid out)."""

    def __init__(self, gathered: Any, micro_batches: list, losses: list, backward_roots: list,
                 optimizer_stepped: bool, skipped_on_device: bool, judged_on_device: bool = False,
                 replaced: bool = False):
        self.gathered = gathered
        self.micro_batches = micro_batches
        self.losses = losses
        self.backward_roots = backward_roots
        self.optimizer_stepped = optimizer_stepped
        self.skipped_on_device = skipped_on_device  # a non-finite update was dropped by the device skip
        self.judged_on_device = judged_on_device  # its mirrored values end with the device's divergence verdict
        self.replaced = replaced  # a rewind replaced the weights it ran on (judged late): its update was dropped
