"""Planted faults and small training loops for the watch tests (tiny real models, CPU)."""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from nbguard.testing import tiny_batch
from nbguard.watcher.reads import clip_tap


def output_absmax(model, module, batch) -> float:
    """The abs-max output of ``module`` on ``batch`` in fp32 (to plant an overflow of known size)."""
    seen = []
    handle = module.register_forward_hook(lambda m, a, out: seen.append(out.detach().abs().max().item()))
    try:
        with torch.no_grad():
            model(**batch)
    finally:
        handle.remove()
    return max(seen)


def scale_output_to(model, linear, batch, absmax: float) -> None:
    """Scale ``linear``'s weight so its output abs-max on ``batch`` becomes ``absmax``."""
    factor = absmax / output_absmax(model, linear, batch)
    with torch.no_grad():
        linear.weight.mul_(factor)
        if linear.bias is not None:
            linear.bias.mul_(factor)


class _NanGrad(torch.autograd.Function):
    """Identity forward; its backward returns NaN (a broken custom kernel)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


class PoisonedSiLU(torch.nn.Module):
    """SiLU whose backward makes NaN while its forward stays finite (while ``armed``)."""

    def __init__(self, armed: bool = True):
        super().__init__()
        self.armed = armed

    def forward(self, x):
        return _NanGrad.apply(F.silu(x)) if self.armed else F.silu(x)


def autocast_ctx(dtype, device_type: str = "cpu"):
    return torch.autocast(device_type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


def train(model, optimizer, batches, *, scaler=None, autocast=None, accumulation: int = 1):
    """A plain loop: forward (HF loss), backward, optional GradScaler and accumulation (autocast on
    the model's device type)."""
    device_type = next(model.parameters()).device.type
    losses = []
    for i, batch in enumerate(batches):
        with autocast_ctx(autocast, device_type):
            loss = model(**batch).loss / accumulation
        (scaler.scale(loss) if scaler is not None else loss).backward()
        losses.append(loss.detach())
        if (i + 1) % accumulation == 0:
            if scaler is not None:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            optimizer.zero_grad()
    return losses


def batches(n: int, batch_size: int = 2, seq_len: int = 12, avoid: int | None = None, seed: int = 0):
    """``n`` tiny batches; ``avoid`` replaces one token id everywhere (so a poisoned row is not hit)."""
    out = []
    for i in range(n):
        b = tiny_batch(batch_size, seq_len, seed=seed + i)
        if avoid is not None:
            for key in ("input_ids", "labels"):
                b[key] = torch.where(b[key] == avoid, torch.full_like(b[key], avoid + 1), b[key])
        out.append(b)
    return out


def with_token(batch, token: int):
    batch = {k: v.clone() for k, v in batch.items()}
    batch["input_ids"][0, 3] = token
    return batch


def hook_counts(model, optimizer=None, scaler=None) -> dict:
    """Every hook dict nbguard could touch, counted, for attach/detach checks."""
    counts = {}
    for name, m in model.named_modules():
        counts[f"{name}:modules"] = (len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks),
                                     len(m._backward_pre_hooks), len(m._forward_hooks_with_kwargs),
                                     len(m._forward_pre_hooks_with_kwargs))
    for name, p in model.named_parameters():
        counts[f"{name}:param"] = (len(p._post_accumulate_grad_hooks or {}), len(p._backward_hooks or {}))
    if optimizer is not None:
        counts["optimizer"] = (len(optimizer._optimizer_step_pre_hooks), len(optimizer._optimizer_step_post_hooks),
                               "zero_grad" in vars(optimizer))
    if scaler is not None:
        counts["scaler"] = tuple(name in vars(scaler) for name in ("update", "unscale_", "step"))  # (any we wrap)
    counts["clip_grad_norm_ wrapped"] = clip_tap.tapped()
    return counts


def snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def identical(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a if not torch.isnan(a[k]).any()) and all(
        torch.equal(torch.isnan(a[k]), torch.isnan(b[k])) for k in a)
