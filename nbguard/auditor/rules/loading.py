"""Weights that never loaded: a "pretrained" model that predicts like a random one.

``from_pretrained`` fills every weight the checkpoint does not hold (a renamed key, a checkpoint of
another architecture or saved under another prefix) with a fresh random initialisation and only logs
it. transformers 5 keeps no record on the model: the missing and unexpected keys come back only with
``from_pretrained(..., output_loading_info=True)``. A model whose weights never loaded predicts every
token about equally: its first-batch loss is near ln(vocab) and its logits are near flat, where a
loaded language model starts far below. The audit runs one forward of the batch (no gradients, modes
and RNG put back) and, when the model is that flat, compares the checkpoint's key names (read from
its local safetensors files, where ``config._name_or_path`` points to them) with the model's own to
name what did not load. The keys alone decide nothing (weight conversions rename keys on load), and a
flat model whose checkpoint holds every one of its weights loaded them (a random checkpoint): quiet.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from ..registry import capped, finding, rule
from .dry_forward import dry_forward

NEAR = 0.05  # loss within 5% of ln(vocab)
FLAT = 0.95  # mean next-token entropy at least 95% of ln(vocab)


def checkpoint_keys(name_or_path: str) -> set[str] | None:
    """The tensor names in a local checkpoint's safetensors files (names only: no tensor is read), else None."""
    folder = Path(name_or_path) if name_or_path else None
    if folder is None or not folder.is_dir():
        return None
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    from ...introspect.user_files import UserFileError, safetensors_header

    keys: set[str] = set()
    for file in files:
        try:  # the header alone, bounded; a FIFO or a corrupt file is not compared (the load said what it could)
            keys.update(safetensors_header(str(file)))
        except UserFileError:
            return None
    return keys


def key_diff(model: torch.nn.Module, keys: set[str]) -> tuple[list[str], list[str]]:
    """(missing, unexpected): model weights absent from the checkpoint (a tied copy of a present one is not
    missing), and checkpoint tensors the model has no place for."""
    state = model.state_dict(keep_vars=True)
    present = {id(t) for k, t in state.items() if k in keys}
    missing = sorted(k for k, t in state.items() if k not in keys and id(t) not in present)
    unexpected = sorted(k for k in keys if k not in state)
    return missing, unexpected


def flatness(output: Any, labels: torch.Tensor, vocab: int) -> tuple[float, float] | None:
    """(loss, mean next-token entropy) of a causal LM's output over its supervised positions, else None."""
    loss = getattr(output, "loss", None)
    logits = getattr(output, "logits", None)
    if loss is None or logits is None or logits.shape[-1] != vocab:
        return None
    supervised = labels[..., 1:] != -100
    if not bool(supervised.any()):
        return None
    logp = torch.log_softmax(logits[..., :-1, :].float(), dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)[supervised.to(logits.device)]
    return float(loss), float(entropy.mean())


@rule("weights-not-loaded", "error")
def weights_not_loaded(ctx):
    """A pretrained model whose first-batch loss is near ln(vocab) with near-flat logits: its weights never loaded."""
    model = ctx.model
    config = getattr(model, "config", None)
    source = getattr(config, "_name_or_path", "") or ""
    if model is None or not source or not ctx.batches or ctx.is_peft:
        return None  # (a model built from a config is random on purpose)
    batch = ctx.batches[0]
    if "labels" not in batch or any(p.device.type == "meta" for _, p in ctx.named_params[:1]):
        return None
    embeddings = ctx.input_embeddings
    vocab = getattr(getattr(embeddings, "weight", None), "shape", (0,))[0]
    if vocab < 2:
        return None
    output, error = dry_forward(model, batch, ctx.trainer)
    measured = flatness(output, batch["labels"], vocab) if error is None else None
    if measured is None:
        return None
    loss, entropy = measured
    uniform = math.log(vocab)
    if abs(loss / uniform - 1) > NEAR or entropy < FLAT * uniform:
        return None
    keys = checkpoint_keys(source)
    missing, unexpected = key_diff(model, keys) if keys is not None else ([], [])
    if keys is not None and not missing:
        return None  # every weight loaded: the checkpoint itself is this flat (a random one saved as is)
    said = (f"{len(missing)} of the model's weights are not in the checkpoint ({', '.join(missing[:3])}"
            f"{'...' if len(missing) > 3 else ''})" if missing else
            "its checkpoint is not a local folder of safetensors files, so its keys were not compared")
    return finding(
        "weights-not-loaded",
        f"the pretrained weights did not load: first-batch loss {loss:.4g} is ln(vocab) = {uniform:.4g}",
        f"The model from {source!r} predicts every token about equally (loss {loss:.4g} vs ln({vocab}) = {uniform:.4g}; "
        f"mean next-token entropy {entropy:.4g}): {said}. from_pretrained initialised what it did not find at random "
        "and only logged it. Check the checkpoint's key names against the model class (a renamed prefix, another "
        "architecture, a PEFT adapter saved as a full model): load it with from_pretrained(..., "
        "output_loading_info=True) and read missing_keys / unexpected_keys before training.",
        {"loss": loss, "ln_vocab": uniform, "vocab_size": vocab, "mean_entropy": entropy, "source": source,
         "missing_keys": capped(missing), "unexpected_keys": capped(unexpected),
         "keys_compared": keys is not None})
