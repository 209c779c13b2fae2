"""Localising a non-finite loss computed by a fused linear cross-entropy (Liger's, above all).

A fused loss multiplies the last hidden states by the output embedding's weight and takes the cross
entropy in one kernel, chunk by chunk, so the logits are never materialised (the output's ``logits``
is None) and the output embedding (``lm_head``) never runs as a module: no hook sees it. The replay
then stops at the model whose ``forward`` computed the loss. Everything that ran before it was
finite (the replay stops at the first non-finite value), so the hidden states entering the fused
loss were finite, and what the loss read besides them is the output embedding's weight (and bias):
that module is the origin, with the model's forward as the reader.
"""
from __future__ import annotations

from typing import Any

import torch

from ...findings import Origin
from ...introspect.liger import fused_loss_forward
from ...step.tensors import Summary, nonfinite_params

LOSS_PATH = "loss"  # the path summarize() gives an output's loss field


def _output_embedding(module: torch.nn.Module) -> torch.nn.Module | None:
    getter = getattr(module, "get_output_embeddings", None)
    try:
        head = getter() if callable(getter) else None
    except Exception:  # a model without an output embedding raises in some families
        return None
    return head if isinstance(head, torch.nn.Module) else None


def _decoder(module: torch.nn.Module) -> torch.nn.Module | None:
    getter = getattr(module, "get_decoder", None)
    try:
        decoder = getter() if callable(getter) else None
    except Exception:
        decoder = None
    if decoder is None:
        decoder = getattr(module, str(getattr(module, "base_model_prefix", "") or "model"), None)
    return decoder if isinstance(decoder, torch.nn.Module) and decoder is not module else None


def fused_loss_origin(module: torch.nn.Module, output: Any, found: Summary, names: dict[torch.nn.Module, str],
                      outputs: dict[torch.nn.Module, Summary], micro_batch: int) -> tuple[str, Origin] | None:
    """(cause, origin) naming the output embedding the fused loss read, when ``module``'s first
    non-finite output is its loss and it returned no logits; else None (the replay's origin stands)."""
    if found.first_bad != LOSS_PATH or getattr(output, "logits", 0) is not None:
        return None
    head = _output_embedding(module)
    if head is None or head in outputs:  # it ran as a module: the logits were made, the hooks saw them
        return None
    kernel = fused_loss_forward(module)
    bad = {f"{sub}.{param}" if sub else param: count  # a PEFT wrapper holds the weight one level down
           for sub, part in head.named_modules() for param, count in nonfinite_params(part).items()}
    decoder = _decoder(module)
    hidden = outputs.get(decoder) if decoder is not None else None
    head_name, model_name = names.get(head, "?"), names.get(module, "?") or type(module).__name__
    decoder_name = names.get(decoder, "?") if decoder is not None else "the decoder"
    fused = (f"Liger's fused linear cross-entropy ({kernel})" if kernel else
             "a fused linear cross-entropy (the output has no logits)")
    weights = (f"it holds non-finite values in {', '.join(bad)}" if bad else
               "its weights were finite: the kernel's own computation overflowed or divided 0/0")
    evidence: dict[str, Any] = {
        "class": type(head).__name__,
        "fused_loss": fused,
        "read_by": f"{model_name}.forward",
        "note": (f"the loss was computed by {fused}, which reads {head_name}'s weight directly without "
                 f"materialising the logits, so {head_name} never ran as a module; its inputs were the hidden "
                 f"states of {decoder_name}; {weights}"),
    }
    if bad:
        evidence["nonfinite_values"] = bad
    if hidden is not None:
        evidence["hidden_states"] = {"module": decoder_name, "finite": hidden.finite,
                                     "absmax": hidden.absmax}
    cause = "nonfinite-parameter" if bad else found.cause
    origin = Origin(head_name, "forward", found.dtype, hidden.absmax if hidden is not None else None,
                    found.absmax, ", ".join(bad) if bad else LOSS_PATH, micro_batch, evidence)
    return cause, origin
