"""Which fixes to try for a watch event (by its cause) or a finding (its own fix ids), with options."""
from __future__ import annotations

from typing import Any

import torch

from ..hardware import resolve_hardware
from .recipes import four_bit_layers
from .shadow import CapturedStep

Candidate = tuple[str, dict[str, Any]]

# Most likely first: automatic verification stops after a few step-level runs.
_NUMERIC = ["init-new-embeddings", "upcast-trainable-fp32", "switch-precision", "enable-grad-clipping",
            "lower-learning-rate"]
CAUSE_FIXES: dict[str, list[str]] = {
    "overflow": _NUMERIC,
    # a left-padded row's first queries attend to nothing: NaN in fp16 SDPA (changes nothing without left padding)
    "invalid-op": _NUMERIC[:1] + ["pad-right-for-training"] + _NUMERIC[1:],
    "nonfinite-parameter": ["enable-grad-clipping", "lower-learning-rate"],
    "no-supervised-tokens": ["drop-unsupervised-rows"],
}


def switch_to(step: CapturedStep, hardware: Any = None) -> str:
    """fp16 steps move to the hardware's best half precision; any other step to fp32."""
    captured = step.micro_batches[0].autocast if step.micro_batches else []
    fp16 = any(t == torch.float16 for _, t in captured) or any(
        p.dtype == torch.float16 for p in step.eager.parameters()) or any(
        m.compute_dtype == torch.float16 for _, m in four_bit_layers(step.eager))
    if fp16:
        return resolve_hardware(hardware).best_half_precision
    return "fp32"  # bf16 has fp32's range: only fp32's precision is left to try


def with_options(fix_ids: list[str], step: CapturedStep, options: dict[str, dict[str, Any]] | None = None,
                 hardware: Any = None) -> list[Candidate]:
    options = options or {}
    out: list[Candidate] = []
    for fix_id in fix_ids:
        chosen = dict(options.get(fix_id, {}))
        if fix_id == "switch-precision" and "to" not in chosen:
            chosen["to"] = switch_to(step, hardware)
        out.append((fix_id, chosen))
    return out


def for_event(event: Any, step: CapturedStep, hardware: Any = None) -> list[Candidate]:
    return with_options(list(CAUSE_FIXES.get(event.cause or "", [])), step, hardware=hardware)
