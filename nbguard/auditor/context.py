"""The facts every rule reads, computed lazily and once per audit.

Rules never walk the model themselves: an 8B model with LoRA on every linear layer has ~2,700
modules, and fifteen rules each walking it would make the audit slow. Each fact here is a
``cached_property`` so a fact no rule needs costs nothing.
"""
from __future__ import annotations

from collections import Counter
from functools import cached_property
from typing import Any

import torch

from ..environment import parsed_version
from ..hardware import Hardware
from ..introspect.dtypes import HALF_DTYPES, QUANTIZED_PARAM_CLASSES
from ..introspect.quantization import read_quantization
from ..introspect.tokenizers import tokenizer_of
from ..introspect.unsloth import float32_forced_without_autocast, read_unsloth


class AuditContext:
    def __init__(self, model=None, trainer=None, args=None, batch=None, hardware: Hardware | None = None, probe=None,
                 optimizer=None, scaler=None):
        self.model = model
        self.trainer = trainer
        # a plain loop's optimizer and GradScaler (else the optimizer a Trainer already built)
        self.optimizer = optimizer if optimizer is not None else getattr(trainer, "optimizer", None)
        self.scaler = scaler
        self.args = args
        self.batch = batch
        self.hardware = hardware
        self.probe = probe  # ProbeResult, filled in before the rules run when probe=True

    # ---- parameters -------------------------------------------------------------------------
    @cached_property
    def named_params(self) -> list[tuple[str, torch.nn.Parameter]]:
        return list(self.model.named_parameters()) if self.model is not None else []

    @cached_property
    def quantized_names(self) -> set[str]:
        """Parameters stored quantised (bitsandbytes 4/8-bit, torchao, quanto): never cast these."""
        return {
            n for n, p in self.named_params
            if type(p).__name__ in QUANTIZED_PARAM_CLASSES or not (p.is_floating_point() or p.is_complex())
        }

    @cached_property
    def floating_params(self) -> list[tuple[str, torch.nn.Parameter]]:
        q = self.quantized_names
        return [(n, p) for n, p in self.named_params if n not in q and p.is_floating_point()]

    @cached_property
    def trainable(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(n, p) for n, p in self.floating_params if p.requires_grad]

    @cached_property
    def dtype_counts(self) -> Counter:
        return Counter(p.dtype for _, p in self.floating_params)

    @cached_property
    def trainable_half(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(n, p) for n, p in self.trainable if p.dtype in HALF_DTYPES]

    @cached_property
    def weight_dtype(self) -> torch.dtype | None:
        """The dtype most floating parameters are stored in (what "the model is in bf16" means)."""
        counts: Counter[torch.dtype] = Counter()
        for _, p in self.floating_params:
            counts[p.dtype] += p.numel()
        return counts.most_common(1)[0][0] if counts else None

    # ---- configuration ------------------------------------------------------------------------
    @cached_property
    def config(self) -> Any:
        return getattr(self.model, "config", None) if self.model is not None else None

    @cached_property
    def text_config(self) -> Any:
        """The language model's config (``text_config`` of multimodal models such as Gemma 3)."""
        cfg = self.config
        if cfg is None:
            return None
        getter = getattr(cfg, "get_text_config", None)
        if callable(getter):
            try:
                return getter()
            except Exception:  # some remote-code configs break this helper
                pass
        return getattr(cfg, "text_config", None) or cfg

    @cached_property
    def configs(self) -> list[Any]:
        """The config and its text config, without duplicates (they are the same object for text models)."""
        out: list[Any] = []
        for c in (self.config, self.text_config):
            if c is not None and all(c is not o for o in out):
                out.append(c)
        return out

    @cached_property
    def model_types(self) -> set[str]:
        return {t for t in (getattr(c, "model_type", None) for c in self.configs) if t}

    @cached_property
    def use_cache(self) -> bool:
        return any(getattr(c, "use_cache", False) for c in self.configs)

    @cached_property
    def quantization_config(self) -> Any:
        for c in self.configs:
            q = getattr(c, "quantization_config", None)
            if q is not None:
                return q
        return None

    @cached_property
    def quantization(self):
        """The bitsandbytes 4/8-bit layers and the dtype each 4-bit layer really computes in."""
        return read_quantization(self.model, self.quantization_config, self.modules,
                                 [p for _, p in self.named_params])

    @cached_property
    def unsloth(self):
        """The markers Unsloth left on the model, trainer and environment (introspect/unsloth.py)."""
        return read_unsloth(self.model, self.trainer, self.args)

    @cached_property
    def cuda_build(self):
        """What this environment's torch and CUDA extensions carry kernels for (introspect/cuda_archs.py)."""
        from ..introspect.cuda_archs import read_cuda_build

        return read_cuda_build()

    @cached_property
    def is_peft(self) -> bool:
        return hasattr(self.model, "peft_config") or any(
            c.__module__.startswith("peft.") for c in type(self.model).__mro__
        )

    @cached_property
    def input_embeddings(self):
        getter = getattr(self.model, "get_input_embeddings", None)
        try:
            return getter() if callable(getter) else None
        except (NotImplementedError, AttributeError):
            return None

    @cached_property
    def modules(self) -> list[tuple[str, torch.nn.Module]]:
        return list(self.model.named_modules()) if self.model is not None else []

    @cached_property
    def checkpointed_modules(self) -> list[tuple[str, torch.nn.Module]]:
        return [(n, m) for n, m in self.modules if getattr(m, "gradient_checkpointing", False) is True]

    @cached_property
    def input_grad_hooks(self) -> bool:
        """Whether ``enable_input_require_grads`` (transformers or PEFT) has hooked the embeddings."""
        return any(getattr(m, "_require_grads_hook", None) is not None or getattr(m, "_require_grads_hooks", None)
                   for _, m in self.modules)

    # ---- batches ------------------------------------------------------------------------------
    @cached_property
    def sample(self):
        """The batch given to the audit, else a few batches from the trainer's own dataloader."""
        from .sampling import BatchSample, sample_trainer_batches

        if self.batch is not None:
            return BatchSample(batches=[self.batch], source="batch")
        if self.trainer is not None:
            try:
                return sample_trainer_batches(self.trainer)
            except Exception as exc:  # one finding says so (batch-sampling-error); the batch rules see no batch
                return BatchSample(source="trainer", note="the trainer's dataloader raised",
                                   error=f"{type(exc).__name__}: {exc}")
        return BatchSample(note="no batch= and no trainer= to sample from")

    @cached_property
    def batches(self) -> list[dict[str, torch.Tensor]]:
        return self.sample.batches

    @cached_property
    def tokenizer(self) -> Any:
        """The trainer's tokenizer (``processing_class``; ``tokenizer`` before transformers 4.46), or its collator's."""
        for owner in (self.trainer, getattr(self.trainer, "data_collator", None)):
            tok = tokenizer_of(owner)
            if tok is not None and hasattr(tok, "pad_token_id"):
                return tok
        return None

    # ---- training arguments -------------------------------------------------------------------
    @cached_property
    def requested_precision(self) -> str | None:
        """"fp16" / "bf16" when the arguments ask for mixed precision, else None."""
        if self.args is None:
            return None
        if getattr(self.args, "fp16", False):
            return "fp16"
        if getattr(self.args, "bf16", False):
            return "bf16"
        return None

    @cached_property
    def runs_on_cpu(self) -> bool:
        """The Trainer will run on the CPU: the hardware is a CPU, or use_cpu=True on this machine (a GPU the
        user names with hardware= is where they mean to run, so use_cpu there is read as left over)."""
        if self.hardware is not None and self.hardware.device_type == "cpu":
            return True
        return bool(getattr(self.args, "use_cpu", False)) and (self.hardware is None or self.hardware.detected)

    @cached_property
    def ignored_precision(self) -> str | None:
        """The mixed-precision flag the backend drops: accelerate turns on fp16 autocast and a GradScaler only
        off the CPU (Accelerator.__init__: native_amp stays False for fp16 on "cpu"), so fp16 on CPU trains fp32.
        bf16 on CPU is real (CPU autocast to bfloat16)."""
        return "fp16" if self.requested_precision == "fp16" and self.runs_on_cpu else None

    @cached_property
    def mixed_precision(self) -> str | None:
        """The mixed precision the run really uses: the flag, unless the backend ignores it here."""
        return None if self.ignored_precision else self.requested_precision

    @cached_property
    def uses_fp16(self) -> bool:
        """fp16 in play: mixed precision, fp16 eval, or fp16 weights (not Unsloth's forced-float32
        mode, where fp16 storage is by design and autocast is off)."""
        if float32_forced_without_autocast(self.unsloth, self.mixed_precision):
            return False
        return (
            self.mixed_precision == "fp16"
            or bool(getattr(self.args, "fp16_full_eval", False))
            or self.weight_dtype == torch.float16
        )

    @cached_property
    def eval_strategy(self) -> str | None:
        """"no", "steps" or "epoch" (``evaluation_strategy`` in older releases)."""
        strategy = getattr(self.args, "eval_strategy", None) or getattr(self.args, "evaluation_strategy", None)
        return None if strategy is None else str(getattr(strategy, "value", strategy))

    @cached_property
    def evaluates_during_training(self) -> bool:
        return self.eval_strategy not in (None, "no")

    @cached_property
    def optimizer_eps(self) -> float | None:
        opt = getattr(self.trainer, "optimizer", None)
        if opt is not None:
            eps = [g.get("eps") for g in opt.param_groups if isinstance(g.get("eps"), float)]
            if eps:
                return min(eps)
        return getattr(self.args, "adam_epsilon", None)

    # ---- environment --------------------------------------------------------------------------
    def version(self, package: str):
        return parsed_version(package)
