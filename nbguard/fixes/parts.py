"""Whether a fix fits what the user has: the objects it acts on, and the part of them it changes.

A fix is offered only where it applies: ``not_offered(fix, target)`` says why not, naming the objects the
user has ("'drop-rows' acts on a Trainer, and there is none here: there is a model (Net) and an optimizer
(SGD)"), or the part their model lacks ("Net has no embedding matrix"). ``LACKS`` holds, per fix that changes one part of a model or optimizer, the
check that the part is there; a fix not in it acts on whatever it is given (a precision switch, clipping).
tests/test_fix_parts.py runs every registered fix against a plain loop without any of these parts.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..introspect.embeddings import embedding_matrices, token_deltas
from ..introspect.modes import applies_dropout
from ..introspect.moe import fused_expert_params, trainable_router_params
from ..introspect.unsloth import read_unsloth
from .registry import Fix, Target


def _kind(obj: Any) -> str:
    return type(obj).__name__


def _config(target: Target) -> str | None:
    """The part every transformers-config fix changes: ``model.config``."""
    if getattr(target.model, "config", None) is None:
        return f"{_kind(target.model)} has no config (it is not a transformers model)"
    return None


def _embeddings(target: Target) -> str | None:
    if embedding_matrices(target.model) or token_deltas(target.model):
        return None
    return f"{_kind(target.model)} has no embedding matrix"


def _dropout(target: Target) -> str | None:
    if any(applies_dropout(m) for m in target.model.modules()):
        return None
    return f"{_kind(target.model)} has no dropout layer"


def _routers(target: Target) -> str | None:
    if trainable_router_params(target.model):
        return None
    return f"{_kind(target.model)} has no trainable MoE router"


def _fused_experts(target: Target) -> str | None:
    if fused_expert_params(target.model):
        return None
    return f"{_kind(target.model)} has no fused MoE experts"


def _adapter(target: Target) -> str | None:
    if isinstance(getattr(target.model, "peft_config", None), dict):
        return None
    return f"{_kind(target.model)} has no PEFT adapter"


def _checkpointing(target: Target) -> str | None:
    if target.args is not None and getattr(target.args, "gradient_checkpointing", False):
        return None
    if getattr(target.model, "is_gradient_checkpointing", False) or any(
            getattr(m, "gradient_checkpointing", False) is True for m in target.model.modules()):
        return None
    return f"{_kind(target.model)} does not checkpoint its gradients"


def _tied(target: Target) -> str | None:
    model = target.model
    inputs = getattr(model, "get_input_embeddings", lambda: None)()
    outputs = getattr(model, "get_output_embeddings", lambda: None)()
    weight = getattr(inputs, "weight", None)
    if weight is not None and weight is getattr(outputs, "weight", None):
        return None
    return f"{_kind(model)} has no tied input and output embeddings"


def _unsloth(target: Target) -> str | None:
    return None if read_unsloth(target.model, target.trainer, target.args).any else \
        f"{_kind(target.model)} was not set up by Unsloth"


def _float8(target: Target) -> str | None:
    if any(type(p).__module__.startswith("torchao") for p in target.model.parameters()):
        return None
    return f"{_kind(target.model)} has no torchao quantised layer"


def _moe_config(target: Target) -> str | None:
    config = getattr(target.model, "config", None)
    getter = getattr(config, "get_text_config", None)
    text = getter() if callable(getter) else config
    if any(hasattr(c, "output_router_logits") for c in (config, text) if c is not None):
        return None
    return f"{_kind(target.model)} has no MoE router configuration (config.output_router_logits)"


def _eval_mode(target: Target) -> str | None:
    if any(not m.training for m in target.model.modules()):
        return None
    return f"{_kind(target.model)} is in training mode already, every module of it"


def _float32_weights(target: Target) -> str | None:
    if any(p.dtype == torch.float32 for p in target.model.parameters()):
        return None
    return f"{_kind(target.model)} has no float32 weight to cast its inputs for"


def _adam(target: Target) -> str | None:
    if any("eps" in g and "betas" in g for g in getattr(target.optimizer, "param_groups", None) or []):
        return None
    return f"{_kind(target.optimizer)} has no eps (it is not an Adam-family optimizer)"


def _both(*checks: Callable[[Target], str | None]) -> Callable[[Target], str | None]:
    def check(target: Target) -> str | None:
        return next((why for why in (c(target) for c in checks) if why is not None), None)
    return check


# fix id -> why the model (or optimizer) lacks the part the fix changes, else None; needs the model given
LACKS: dict[str, Callable[[Target], str | None]] = {
    "disable-dropout": _dropout,
    "dropout-train-mode": _dropout,
    "disable-use-cache": _config,
    "set-attn-implementation": _config,
    "enable-input-require-grads": _config,
    "enable-router-aux-loss": _moe_config,
    "freeze-moe-router": _routers,
    "lora-target-fused-experts": _both(_fused_experts, _adapter),
    "init-new-embeddings": _embeddings,
    "resize-token-embeddings": _config,
    "untie-embeddings": _tied,
    "merge-in-fp32": _adapter,
    "resave-adapter": _adapter,
    "save-embedding-layers": _adapter,
    "non-reentrant-checkpointing": _checkpointing,
    "disable-cudnn-sdp": _config,  # an attention backend: a transformers model's attention runs SDPA
    "unsloth-precision": _unsloth,
    "float8-activation-lb": _float8,
    "optimizer-eps-for-dtype": _adam,
    "model-train-mode": _eval_mode,
    "cast-inputs-to-float32": _float32_weights,
}


def has(target: Target) -> str:
    """The objects a target holds, as a user reads them: "a model (Net) and an optimizer (SGD)"."""
    parts = [f"{what} ({_kind(obj)})" for what, obj in (
        ("a Trainer", target.trainer), ("TrainingArguments", target.args if target.trainer is None else None),
        ("a model", target.model if target.trainer is None else None), ("a tokenizer", target.tokenizer),
        ("an optimizer", target.optimizer if target.trainer is None else None)) if obj is not None]
    if not parts:
        return "nothing it can act on"
    return ", ".join(parts[:-1]) + (" and " if len(parts) > 1 else "") + parts[-1]


def not_offered(fix: Fix, target: Target) -> str | None:
    """Why ``fix`` does not apply to ``target`` (naming what the user has), or None when it does."""
    given = {key for key in ("model", "trainer", "args", "tokenizer", "optimizer") if getattr(target, key) is not None}
    if fix.needs == "tokenizer":
        given = {"tokenizer"} if target.tokenizer is not None or target.trainer is not None else set()
    if not fix.reached_by(given):
        return f"{fix.id!r} acts on {fix.need.wanted}, and there is none here: there is {has(target)}"
    why = missing_part(fix, target)
    return f"{fix.id!r} changes nothing here: {why}" if why is not None else None


def missing_part(fix: Fix, target: Target) -> str | None:
    """Why the target lacks the part ``fix`` changes (its model's, or its optimizer's eps), else None; None too
    when the object holding that part was not given (nothing to judge)."""
    lacks = LACKS.get(fix.id)
    holder = target.optimizer if fix.id == "optimizer-eps-for-dtype" else target.model
    return lacks(target) if lacks is not None and holder is not None else None
