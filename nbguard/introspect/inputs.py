"""Checking what the user handed to the audit, with errors that name the argument.

transformers is recognised by class ancestry (``Trainer``, ``TrainingArguments`` in the MRO) so
nbguard never imports it just to check a type, and TRL's trainers (subclasses) pass as well.
"""
from __future__ import annotations

from typing import Any


def _has_ancestor(obj: Any, class_name: str, module_prefix: str = "transformers") -> bool:
    return any(c.__name__ == class_name and c.__module__.startswith(module_prefix) for c in type(obj).__mro__)


def is_trainer(obj: Any) -> bool:
    return _has_ancestor(obj, "Trainer")


def is_training_args(obj: Any) -> bool:
    return _has_ancestor(obj, "TrainingArguments")


def check_model(model: Any, name: str = "model") -> None:
    import torch

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{name} must be a torch.nn.Module (a transformers or PEFT model); got {type(model).__name__}")


def check_trainer(trainer: Any) -> None:
    if not is_trainer(trainer):
        raise TypeError(
            f"trainer must be a transformers Trainer (or a subclass such as TRL's SFTTrainer); got {type(trainer).__name__}"
        )


def check_args(args: Any) -> None:
    if not is_training_args(args):
        raise TypeError(
            f"args must be a transformers TrainingArguments (or a subclass such as SFTConfig); got {type(args).__name__}"
        )


def check_batch(batch: Any) -> None:
    """A mapping of tensors (a dict, or the BatchEncoding a tokenizer or collator returns)."""
    from collections.abc import Mapping

    import torch

    if not isinstance(batch, Mapping) or not batch:
        raise TypeError(
            f"batch must be a non-empty dict of tensors (input_ids, attention_mask, labels); got {type(batch).__name__}"
        )
    bad = [k for k, v in batch.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise TypeError(f"batch must be a dict of tensors; the values of {bad} are not tensors")
    if "input_ids" not in batch and "inputs_embeds" not in batch:
        raise ValueError("batch needs 'input_ids' (or 'inputs_embeds'); it has " + ", ".join(map(repr, batch)))
