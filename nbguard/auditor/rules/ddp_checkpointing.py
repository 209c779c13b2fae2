"""DDP + reentrant activation checkpointing + find_unused_parameters: "marked a variable ready twice".

With ``find_unused_parameters=True`` DDP walks the autograd graph after the forward and marks every
parameter it does not reach as ready at once. Reentrant checkpointing hides the checkpointed layers'
parameters from that graph (they are recomputed inside a nested backward), so they are marked ready
after the forward and again when their gradient arrives: "Expected to mark a variable ready only
once". The Trainer asks for ``find_unused_parameters=True`` whenever the model is not a
``PreTrainedModel`` (a PEFT model) and ``ddp_find_unused_parameters`` is unset: LoRA + checkpointing
+ several GPUs is the usual way in (trl#4782, accelerate#3536).
"""
from __future__ import annotations

import torch

from ..registry import finding, rule


def world_size(ctx) -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return int(getattr(ctx.args, "world_size", 1) or 1)


def _checkpoint_kwargs(args) -> dict | None:
    for name in ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs"):
        value = getattr(args, name, None)
        if isinstance(value, dict):
            return value
    return None


def uses_reentrant(ctx) -> bool | None:
    """Whether the checkpointing the run will use is reentrant; None when nothing is checkpointed.

    The model's own checkpoint function (set by gradient_checkpointing_enable) says so first; else the
    arguments the Trainer will enable it with. An unset use_reentrant is torch's reentrant default.
    """
    for _, module in ctx.checkpointed_modules:
        keywords = getattr(getattr(module, "_gradient_checkpointing_func", None), "keywords", None)
        if isinstance(keywords, dict):
            return keywords.get("use_reentrant") is not False
    if ctx.checkpointed_modules:
        return True
    args = ctx.args
    if not (getattr(args, "gradient_checkpointing", False) or getattr(args, "activation_checkpointing", False)):
        return None
    kwargs = _checkpoint_kwargs(args)
    if kwargs is not None and "use_reentrant" in kwargs:
        return kwargs["use_reentrant"] is not False
    tf = ctx.version("transformers")
    return tf is None or tf.major < 5  # transformers 5 enables checkpointing with use_reentrant=False


def finds_unused(ctx) -> bool:
    """The find_unused_parameters DDP will get: the argument, else the Trainer's default."""
    from transformers import PreTrainedModel

    explicit = getattr(ctx.args, "ddp_find_unused_parameters", None)
    if explicit is not None:
        return bool(explicit)
    return not isinstance(ctx.model, PreTrainedModel)  # a PreTrainedModel with checkpointing gets False


@rule("ddp-reentrant-checkpointing", "error")
def ddp_reentrant_checkpointing(ctx):
    """Several processes, reentrant activation checkpointing and find_unused_parameters: DDP marks a variable ready twice."""
    size = world_size(ctx)
    if size < 2 or ctx.model is None or not uses_reentrant(ctx) or not finds_unused(ctx):
        return None
    return finding(
        "ddp-reentrant-checkpointing", "DDP with reentrant checkpointing and find_unused_parameters will fail",
        f"{size} processes, reentrant activation checkpointing and find_unused_parameters=True"
        + (" (the Trainer's default for a PEFT model)" if getattr(ctx.args, "ddp_find_unused_parameters", None) is None
           else "")
        + ": DDP marks the checkpointed layers' parameters unused after the forward and again when their gradients "
          "arrive, and the first backward raises \"Expected to mark a variable ready only once\". Checkpoint with "
          "use_reentrant=False (gradient_checkpointing_kwargs={'use_reentrant': False}), or set "
          "ddp_find_unused_parameters=False.",
        {"world_size": size, "use_reentrant": True, "find_unused_parameters": True,
         "peft": ctx.is_peft}, fixes=["non-reentrant-checkpointing"])
