"""HF ``Trainer`` / TRL ``SFTTrainer``: a callback finds the optimizer (created lazily inside
``train()``) and the accelerator's GradScaler, ends training on ``stop``, and watches eval loss."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from transformers import TrainerCallback

from ..core.guard import OnError, warn_failure
from .instance_wrap import InstanceWrap


def trainer_scaler(trainer):
    accelerator = getattr(trainer, "accelerator", None)
    return getattr(accelerator, "scaler", None)


class _MethodTap:
    """Wraps ``trainer.<method>`` with an invisible instance wrapper (its signature and name are the
    method's); ``remove`` puts back what the instance had."""

    method = ""

    def __init__(self, trainer, around: Callable[..., Any], on_error: OnError = warn_failure):
        self.trainer = trainer
        self._wrap = InstanceWrap(trainer, self.method, around, on_error)

    def remove(self) -> None:
        self._wrap.remove()


class LabelsTap(_MethodTap):
    """Keeps the labels the Trainer hands to ``compute_loss`` for the next training forward.

    With ``compute_loss_func`` or label smoothing the Trainer pops the labels before calling the
    model, where micro-batches are captured; without this tap an all -100 batch (a 0/0 loss) would
    look like an unexplained NaN. Installed as an instance attribute and removed on detach.
    """

    method = "compute_loss"

    def __init__(self, trainer, on_error: OnError = warn_failure):
        self.labels: torch.Tensor | None = None

        def compute_loss(original, model, inputs, *args, **kwargs):
            labels = inputs.get("labels") if isinstance(inputs, Mapping) else None
            self.labels = labels if isinstance(labels, torch.Tensor) else None
            return original(model, inputs, *args, **kwargs)

        super().__init__(trainer, compute_loss, on_error)

    def take(self) -> torch.Tensor | None:
        """The labels of the forward about to run; each set is handed out once."""
        labels, self.labels = self.labels, None
        return labels


def trainer_computes_its_loss(trainer) -> bool:
    """Whether the loss a Trainer trains on may differ from the one its model returns: a
    ``compute_loss`` written outside transformers' Trainer (TRL's GRPO, DPO, KTO, RLOO and SFT
    trainers, a user's subclass or one set on the instance) or a ``compute_loss_func``. TRL's GRPO
    and DPO pass labels to the model for its log-probabilities, so the model's own ``loss`` is a
    language-model loss beside the point, not the loss that is backpropagated and logged."""
    if "compute_loss" in vars(trainer) or getattr(trainer, "compute_loss_func", None) is not None:
        return True
    owner = next((c for c in type(trainer).__mro__ if "compute_loss" in vars(c)), None)
    return owner is not None and owner.__module__ != "transformers.trainer"


class TrainingLossTap(_MethodTap):
    """Hands each loss ``training_step`` returns to ``on_loss``: what the Trainer backpropagated for
    that micro-batch (divided by the accumulation steps where the Trainer divides), whose sum over a
    step is the loss the Trainer logs. Installed as an instance attribute and removed on detach."""

    method = "training_step"

    def __init__(self, trainer, on_loss: Callable[[torch.Tensor], None], on_error: OnError = warn_failure):
        def training_step(original, model, inputs, *args, **kwargs):
            loss = original(model, inputs, *args, **kwargs)
            if isinstance(loss, torch.Tensor):
                on_loss(loss)
            return loss

        super().__init__(trainer, training_step, on_error)


class WatchCallback(TrainerCallback):
    """Drives the watch through its public interface (``begin_training``, ``bind_trainer_step``,
    ``stop_requested``, ``record_log``, ``end_training``); each of those is guarded."""

    def __init__(self, watch):
        self.watch = watch

    def on_train_begin(self, args, state, control, **kwargs):
        self.watch.begin_training(control)  # a new train() call starts clean

    def on_step_begin(self, args, state, control, **kwargs):
        self.watch.begin_step()  # an interrupted step's leftovers never reach this one
        self.watch.bind_trainer_step(control)

    def on_step_end(self, args, state, control, **kwargs):
        if self.watch.stop_requested:
            control.should_training_stop = True
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        # TRL's GRPO/DPO metrics and evaluate()'s eval_loss all arrive here, after the step
        if logs:
            self.watch.record_log(logs)

    def on_train_end(self, args, state, control, **kwargs):
        self.watch.end_training()
