"""A seconds-long probe of cuDNN SDPA's backward on a padded batch, on the user's own GPU.

A known bug is checked, not assumed: NaN gradients from cuDNN attention's backward with a padding mask
were reported on several torch releases (pytorch#139298), yet on an H200 with torch 2.11 it gave finite
gradients in 10 of 10 configurations (bf16/fp16, bool and float masks, fully masked rows, head dims
64-256). So the audit runs the backend itself, forced with ``sdpa_kernel(CUDNN_ATTENTION)``, at the
model's head dim and dtype, and warns only when the NaN reproduces.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass
class CudnnProbe:
    reproduced: bool | None  # None: the backend could not run here (the reason says why)
    reason: str
    head_dim: int
    dtype: str
    seconds: float

    def to_evidence(self) -> dict:
        return {"reproduced": self.reproduced, "reason": self.reason, "head_dim": self.head_dim, "dtype": self.dtype,
                "seconds": round(self.seconds, 3)}


def probe_cudnn_sdpa_backward(head_dim: int, dtype: torch.dtype, device: str = "cuda",
                              seq_len: int = 128, heads: int = 4) -> CudnnProbe:
    """Forward and backward of SDPA on the cuDNN backend with a right-padded boolean mask (one row half padded,
    one query row fully masked); whether any input gradient is non-finite."""
    name = str(dtype).replace("torch.", "")
    started = time.perf_counter()
    if not torch.cuda.is_available():
        return CudnnProbe(None, "no CUDA device on this machine", head_dim, name, 0.0)
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return CudnnProbe(None, f"torch {torch.__version__} has no sdpa_kernel", head_dim, name, 0.0)
    generator = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(2, heads, seq_len, head_dim, device=device, dtype=dtype, generator=generator,
                           requires_grad=True) for _ in range(3))
    mask = torch.ones(2, 1, seq_len, seq_len, device=device, dtype=torch.bool)
    mask[1, :, :, seq_len // 2:] = False  # the second row's keys half padding
    mask[1, :, -1, :] = False  # and one query that attends to nothing
    try:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            out.float().sum().backward()
        torch.cuda.synchronize()
    except RuntimeError as exc:  # the backend refuses this shape/dtype/mask, or this build has none
        return CudnnProbe(None, f"the cuDNN backend did not run: {str(exc).splitlines()[0][:160]}", head_dim, name,
                          time.perf_counter() - started)
    grads = [t.grad for t in (q, k, v)]
    finite = all(g is not None and bool(torch.isfinite(g).all()) for g in grads)
    return CudnnProbe(not finite, "non-finite gradients" if not finite else "every gradient finite", head_dim, name,
                      time.perf_counter() - started)
