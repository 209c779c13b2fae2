"""Will a TRL RL run (GRPO, RLOO, Online DPO) fit its GPU with the generation engine beside it?

Counted against the device's memory (``USABLE_FRACTION`` of it, as :mod:`.memory` does):

- the training state: weights, gradients and optimizer state of the trainable parameters, and the CUDA
  context reserve (:func:`.memory.estimate_memory`, as the model is stored);
- the engine's share: with ``use_vllm`` in ``vllm_mode="colocate"`` vLLM takes
  ``vllm_gpu_memory_utilization`` of the whole device for its weights and KV cache, in the trainer's own
  process (in ``"server"`` mode it runs on other GPUs and costs nothing here);
- the logits of one micro-batch: ``per_device_train_batch_size x max_completion_length x vocab``, twice (the
  logits and their temperature-scaled copy, both kept for backward), unless the trainer scores completions
  through TRL's fused LM head, which projects in tiles and never materialises them (trl#3678).

The peak: everything at once; with ``vllm_enable_sleep_mode`` the engine sleeps during the training step,
so the peak is the larger of the step (training state + logits) and the wake-up (training state + the
engine's share: the trainer's weights and optimizer state stay resident while vLLM wakes, unsloth#3302).
Activations are not counted: like the rest of the memory audit this is a floor, so "does not fit" is certain.
"""
from __future__ import annotations

import importlib
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from ..introspect.trl import GENERATING, completion_cap, config_stack, trl_stack
from .memory import GIB, USABLE_FRACTION, estimate_memory

LOGITS_COPIES = 2  # the logits and logits / temperature, both saved for the log-softmax's backward
KV_MARGIN = 0.05  # of the device, above the engine's weights, left for vLLM's KV cache in an offered utilization
FUSED_FAMILIES = ("grpo", "rloo")  # the trainers TRL gives a fused LM head (trl.trainer.utils.add_fused_lm_head)


def _fused_forward(module: Any) -> bool:
    forward = getattr(module, "__dict__", {}).get("forward")
    code = getattr(getattr(forward, "__func__", forward), "__code__", None)
    return code is not None and code.co_name == "_fused_forward"


def fused_lm_head(trainer: Any, args: Any, stack: str | None) -> bool:
    """Does the trainer score completions through TRL's fused LM head? Read off the trainer's model when
    there is one (TRL patches the model's forward), else whether the installed TRL has it for this family."""
    if trainer is not None:
        model = getattr(trainer, "model", None)
        base = getattr(model, "get_base_model", None)
        return any(_fused_forward(m) for m in (model, base() if callable(base) else None) if m is not None)
    if stack not in FUSED_FAMILIES or config_stack(args) is None:
        return False
    try:  # the args are a TRL config, so TRL is installed
        return hasattr(importlib.import_module("trl.trainer.utils"), "add_fused_lm_head")
    except Exception:
        return False


def _vocab(model: Any) -> int | None:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    if weight is not None and weight.dim() == 2:
        return int(weight.shape[0])
    cfg = getattr(model, "config", None)
    getter = getattr(cfg, "get_text_config", None)
    text = getter() if callable(getter) else cfg
    vocab = getattr(text, "vocab_size", None)
    return vocab if isinstance(vocab, int) else None


@dataclass
class RolloutMemory:
    memory_gb: float
    training_bytes: int  # weights + gradients + optimizer state + reserve
    engine_bytes: int  # vLLM's share on this device (0 in server mode or without vLLM)
    engine_weights_bytes: int  # what the engine's own copy of the weights needs of its share
    logits_bytes: int  # 0 with the fused LM head
    logits_per_row_bytes: int  # one completion row's logits (0 with the fused LM head)
    rows: int
    completion_length: int
    vocab: int
    sleep_mode: bool
    fused: bool
    utilization: float | None
    parts: dict[str, int] = field(default_factory=dict)

    @property
    def usable_bytes(self) -> int:
        return int(self.memory_gb * GIB * USABLE_FRACTION)

    @property
    def peak_bytes(self) -> int:
        step = self.training_bytes + self.logits_bytes
        if self.sleep_mode:
            return max(step, self.training_bytes + self.engine_bytes)
        return step + self.engine_bytes

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.usable_bytes

    def utilization_that_fits(self) -> float | None:
        """The largest ``vllm_gpu_memory_utilization`` (two decimals) with which the peak fits, when it still
        leaves the engine its weights and a KV cache; None when no share does."""
        if not self.engine_bytes:
            return None
        beside = self.training_bytes + (0 if self.sleep_mode else self.logits_bytes)
        if self.sleep_mode and self.training_bytes + self.logits_bytes > self.usable_bytes:
            return None  # the step alone does not fit: no engine share helps
        share = math.floor((self.usable_bytes - beside) / (self.memory_gb * GIB) * 100) / 100
        least = self.engine_weights_bytes / (self.memory_gb * GIB) + KV_MARGIN
        return share if share >= least else None

    def rows_that_fit(self) -> int | None:
        """The largest divisor of ``rows`` (the micro-batch) whose logits fit beside everything else; None when
        the logits are not counted or even one row does not fit."""
        if not self.logits_per_row_bytes:
            return None
        other = self.training_bytes + (0 if self.sleep_mode else self.engine_bytes)
        if self.sleep_mode and self.training_bytes + self.engine_bytes > self.usable_bytes:
            return None
        most = (self.usable_bytes - other) // self.logits_per_row_bytes
        fitting = [r for r in range(1, self.rows) if self.rows % r == 0 and r <= most]
        return max(fitting) if fitting else None

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(peak_gb=round(self.peak_bytes / GIB, 2), usable_gb=round(self.usable_bytes / GIB, 2),
                    fits=self.fits)
        return data


def rollout_memory(ctx: Any, optimizer_bytes_per_value: int) -> RolloutMemory | None:
    """The estimate for a generating TRL run audited against a GPU of known memory; None otherwise."""
    hw, args, trainer = ctx.hardware, ctx.args if ctx.args is not None else getattr(ctx.trainer, "args", None), \
        ctx.trainer
    stack = trl_stack(trainer) if trainer is not None else config_stack(args)
    if stack not in GENERATING or ctx.model is None or hw is None or not hw.is_gpu or hw.memory_gb is None:
        return None
    vocab = _vocab(ctx.model)
    length = completion_cap(trainer) if trainer is not None else getattr(args, "max_completion_length", None)
    rows = getattr(args, "per_device_train_batch_size", None)
    if not (isinstance(vocab, int) and isinstance(length, int) and isinstance(rows, int)) or rows < 1:
        return None
    params = [p for _, p in ctx.named_params]
    training = estimate_memory(ctx.model, "as-is", optimizer_bytes_per_value, params=params)
    colocated = getattr(args, "use_vllm", False) is True and getattr(args, "vllm_mode", None) == "colocate"
    utilization = getattr(args, "vllm_gpu_memory_utilization", None) if colocated else None
    share = float(utilization) if isinstance(utilization, (int, float)) else None
    engine = int(share * hw.memory_gb * GIB) if share is not None else 0
    fused = fused_lm_head(trainer, args, stack)
    logit_size = 2 if ctx.mixed_precision in ("bf16", "fp16") else 4
    head = ctx.model.get_output_embeddings() if hasattr(ctx.model, "get_output_embeddings") else None
    head_weight = getattr(head, "weight", None)
    if ctx.mixed_precision is None and head_weight is not None:
        logit_size = head_weight.element_size()
    per_row = 0 if fused else LOGITS_COPIES * length * vocab * logit_size
    return RolloutMemory(
        memory_gb=hw.memory_gb, training_bytes=training.total_bytes, engine_bytes=engine,
        engine_weights_bytes=min(training.weights_bytes, 2 * training.parameters), logits_bytes=rows * per_row,
        logits_per_row_bytes=per_row, rows=rows, completion_length=length, vocab=vocab,
        sleep_mode=colocated and getattr(args, "vllm_enable_sleep_mode", False) is True, fused=fused,
        utilization=share if engine else None,
        parts={"weights": training.weights_bytes, "gradients": training.grads_bytes,
               "optimizer": training.optimizer_bytes, "reserve": training.reserve_bytes})
