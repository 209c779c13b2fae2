"""HF ``Trainer`` / TRL ``SFTTrainer``: a callback finds the optimizer (created lazily inside
``train()``) and the accelerator's GradScaler, ends training on ``stop``, and watches eval loss."""
from __future__ import annotations

from transformers import TrainerCallback


def trainer_scaler(trainer):
    accelerator = getattr(trainer, "accelerator", None)
    return getattr(accelerator, "scaler", None)


class WatchCallback(TrainerCallback):
    def __init__(self, watch):
        self.watch = watch

    def _bind(self, control):
        self.watch._trainer_control = control
        self.watch._bind_trainer_parts()

    def on_train_begin(self, args, state, control, **kwargs):
        self.watch._stop_requested = False  # a new train() call starts clean
        self._bind(control)

    def on_step_begin(self, args, state, control, **kwargs):
        self._bind(control)

    def on_step_end(self, args, state, control, **kwargs):
        if self.watch._stop_requested:
            control.should_training_stop = True
        return control

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        if metrics and "eval_loss" in metrics:
            self.watch._on_eval_loss(float(metrics["eval_loss"]), state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        self.watch._release_step()
