"""One dry forward on a sampled batch, the way the Trainer will call the model: does it run, and return a loss?

A collator that adds no labels (DataCollatorWithPadding on a causal LM), a processor that drops an
input the model needs in training (``token_type_ids``, ``mm_token_type_ids``), or a model whose head
computes no loss all end the same way: ``train()`` raises on its first step ("The model did not return
a loss from the inputs"). One forward of the first sampled batch (whole: a VLM's pixel_values and image
grids do not split by row), without gradients, in training mode under the trainer's autocast, with every
module's mode and every RNG put back, says so before training.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch

from ...introspect.modes import in_training_mode
from ...step.capture import preserved_rng
from ..registry import finding, rule


def _uses_model_loss(trainer: Any) -> bool:
    """The Trainer takes the loss from the model's output (its own compute_loss, or TRL's SFT one on top of it)."""
    from transformers import Trainer

    if getattr(trainer, "compute_loss_func", None) is not None:
        return False
    owner = next(c for c in type(trainer).__mro__ if "compute_loss" in c.__dict__)
    return owner is Trainer or owner.__module__.startswith("trl.trainer.sft_trainer")


def dry_forward(model: Any, batch: dict[str, torch.Tensor], trainer: Any = None) -> tuple[Any, str | None]:
    """(output, None) or (None, "ExceptionType: message"), in training mode and under the trainer's own autocast,
    as a training step runs it (an eval-mode forward differs: bitsandbytes repacks 4-bit weights for CPU
    inference on its first eval forward, some models require inputs only in training); every module's
    mode and every RNG put back."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    autocast = getattr(trainer, "compute_loss_context_manager", None)
    with preserved_rng(), in_training_mode(model), torch.no_grad(), (
            autocast() if callable(autocast) else contextlib.nullcontext()):
        try:
            return model(**{k: v.to(device) for k, v in batch.items()}), None
        # a missing input raises ValueError/TypeError/KeyError in modelling code; parameters of two dtypes meeting
        # in one matmul (float32 modules in a float16 model, no autocast), RuntimeError: train() raises the same
        except torch.cuda.OutOfMemoryError:  # (torch.OutOfMemoryError from 2.5 on: the same class)
            raise  # this one forward's memory is not the training step's: no prediction from it
        except (ValueError, TypeError, KeyError, RuntimeError) as exc:
            return None, f"{type(exc).__name__}: {exc}"


@rule("forward-returns-no-loss", "error")
def forward_returns_no_loss(ctx):
    """A dry forward of a sampled batch, as the Trainer calls the model, raises or returns no loss."""
    trainer = ctx.trainer
    if trainer is None or not ctx.batches:
        return None
    if any(p.device.type == "meta" for _, p in ctx.named_params[:1]):
        return None
    batch = ctx.batches[0]
    output, error = dry_forward(ctx.model, batch, trainer)
    keys = sorted(batch)
    if error is None:
        if not _uses_model_loss(trainer):
            return None  # (its own compute_loss makes the loss: a forward without one is not a failure)
        loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
        if loss is not None:
            return None
        returned = list(output.keys()) if isinstance(output, dict) else [type(output).__name__]
        return finding(
            "forward-returns-no-loss", "the model returns no loss for the trainer's batches",
            f"A forward of the first sampled batch (inputs: {', '.join(keys)}) returned only {', '.join(returned)}: "
            + ("the batch has no labels, so the model computes no loss. " if "labels" not in batch else "")
            + "train() will stop on its first step with \"The model did not return a loss from the inputs\". "
              "Use a collator that adds labels (DataCollatorForLanguageModeling(tokenizer, mlm=False) for a causal "
              "LM, DataCollatorForSeq2Seq for labelled examples), or keep a labels column through remove_unused_columns.",
            {"inputs": keys, "returned": returned, **ctx.sample.to_evidence()})
    dtypes = parameter_dtypes(ctx.named_params)
    mixed = len(dtypes) > 1 and "dtype" in error
    if mixed:
        cause = (f"The model's parameters are in {len(dtypes)} dtypes ({describe_dtypes(dtypes)}) and this forward runs "
                 "without an autocast that would reconcile them: load the model in one dtype (torch_dtype=...), or let "
                 "the Trainer's bf16=True/fp16=True autocast the forward where the hardware has it.")
    elif error.startswith("RuntimeError"):
        cause = "The error is raised inside the model's own computation; train()'s traceback will show the module."
    else:
        cause = ("A processor or collator that drops an input the model needs in training (token_type_ids, "
                 "pixel_values, mm_token_type_ids) or remove_unused_columns removing it are the usual causes.")
    return finding(
        "forward-returns-no-loss", "the model's forward fails on the trainer's batches",
        f"A forward of the first sampled batch (inputs: {', '.join(keys)}) as the Trainer runs it raised {error}. "
        f"train() will raise the same on its first step. {cause}",
        {"inputs": keys, "exception": error, "parameter_dtypes": {d: names for d, names in dtypes.items()},
         **ctx.sample.to_evidence()})


def parameter_dtypes(named_params: list[tuple[str, torch.Tensor]]) -> dict[str, list[str]]:
    """dtype -> every parameter of that dtype, the most common dtype first."""
    by_dtype: dict[str, list[str]] = {}
    for name, param in named_params:
        by_dtype.setdefault(str(param.dtype).removeprefix("torch."), []).append(name)
    return dict(sorted(by_dtype.items(), key=lambda item: -len(item[1])))


def describe_dtypes(by_dtype: dict[str, list[str]]) -> str:
    """'float16: 19 parameters; float32: 2 (lm_head.weight, model.norm.weight)': every name of the rarer dtypes
    up to eight, and how many more (a list cut short says so)."""
    parts = []
    for i, (dtype, names) in enumerate(by_dtype.items()):
        if i == 0:
            parts.append(f"{dtype}: {len(names)} parameters")
            continue
        shown = ", ".join(names[:8]) + (f", and {len(names) - 8} more" if len(names) > 8 else "")
        parts.append(f"{dtype}: {len(names)} ({shown})")
    return "; ".join(parts)
