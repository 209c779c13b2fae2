"""Rules about tied input/output embeddings under PEFT."""
from __future__ import annotations

from typing import Any

from ...findings import Finding
from ..context import AuditContext
from ..registry import finding, rule


def _adaptation(module: Any) -> str | None:
    """How PEFT adapts ``module`` ('lora', 'modules_to_save', 'trainable_tokens'), or None (read off its PEFT classes)."""
    if module is None:
        return None
    names = {c.__name__ for c in type(module).__mro__ if c.__module__.startswith("peft.")}
    if "ModulesToSaveWrapper" in names:
        return "modules_to_save"
    if names & {"TrainableTokensWrapper", "TrainableTokensLayer"}:
        return "trainable_tokens"
    if "BaseTunerLayer" in names:
        return "lora"
    return None


def _getter(model: Any, name: str) -> Any:
    fn = getattr(model, name, None)
    try:
        return fn() if callable(fn) else None
    except (NotImplementedError, AttributeError):
        return None


def _weight_tying_ensured(model: Any) -> bool:
    configs = getattr(model, "peft_config", None) or {}
    return any(getattr(c, "ensure_weight_tying", False) for c in configs.values())


@rule("tied-embeddings-one-side", "warning")
def tied_embeddings_one_side(ctx: AuditContext) -> Finding | None:
    """Tied input/output embeddings with an adapter (LoRA, modules_to_save) on only one of the pair."""
    if not ctx.is_peft or not any(getattr(c, "tie_word_embeddings", False) for c in ctx.configs):
        return None
    if _weight_tying_ensured(ctx.model):
        return None
    sides = {"input (get_input_embeddings)": _adaptation(_getter(ctx.model, "get_input_embeddings")),
             "output (get_output_embeddings)": _adaptation(_getter(ctx.model, "get_output_embeddings"))}
    adapted = {k: v for k, v in sides.items() if v}
    if len(adapted) != 1:
        return None
    side, how = next(iter(adapted.items()))
    where = side.split()[0]
    if how == "modules_to_save":
        effect = (f"PEFT trains a separate copy of the {where} side, so the pair is untied in effect while "
                  "config.tie_word_embeddings still says True: anything that honours the flag and keeps one matrix "
                  "for both sides loses the trained copy (PEFT warns that merging and converting to formats "
                  "other than safetensors get complicated).")
    else:
        effect = (f"Training applies the adapter on the {where} side only, while merge_and_unload() writes it into "
                  "the shared matrix and so changes the other side as well: the merged model computes something "
                  "else than the model you trained.")
    return finding(
        "tied-embeddings-one-side",
        f"only the {where} side of the tied embeddings is adapted ({how})",
        "The model ties its input embeddings and its output head to one matrix (tie_word_embeddings=True), "
        f"but the adapter ({how}) sits on the {where} side only. {effect} Adapt both sides together "
        "(LoraConfig(..., ensure_weight_tying=True) when you build the adapter), or untie the pair so the "
        "output head gets its own copy of the matrix.",
        {"tie_word_embeddings": True, "adapted": adapted,
         "not_adapted": [k for k, v in sides.items() if not v], "ensure_weight_tying": False},
        fixes=["untie-embeddings"],
    )
