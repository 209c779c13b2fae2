"""Fixes that change the model's configuration: attention implementation, vocabulary size, tied embeddings."""
from __future__ import annotations

from typing import Any

import torch

from ..introspect.embeddings import embedding_shape
from ..step.plan import CapturedStep, ShadowPlan
from .model_fixes import model_configs
from .registry import Fix, register

ATTN_CHOICES = ("eager", "sdpa")


# ---- set-attn-implementation -----------------------------------------------------------------
def _softcapped(model) -> bool:
    cfg = getattr(model, "config", None)
    getter = getattr(cfg, "get_text_config", None)
    text = getter() if callable(getter) else cfg
    return any(getattr(c, "attn_logit_softcapping", None) is not None for c in (cfg, text) if c is not None)


def resolve_attn(model, to: str | None) -> str:
    if to is None:  # softcapping needs eager; everything else runs on sdpa
        return "eager" if _softcapped(model) else "sdpa"
    if to not in ATTN_CHOICES:
        raise ValueError(f"to must be one of {', '.join(ATTN_CHOICES)} or None (eager for softcapped models, "
                         f"else sdpa); got {to!r}")
    return to


def _set_attn(target, to: str | None = None, **_: Any) -> dict:
    model = target.model
    cfg = getattr(model, "config", None)
    if cfg is None:
        raise ValueError(f"set-attn-implementation needs a transformers model; {type(model).__name__} has no config")
    to = resolve_attn(model, to)
    old = getattr(cfg, "_attn_implementation", None)
    if old == to:
        return {}
    setter = getattr(model, "set_attn_implementation", None)
    if callable(setter):  # transformers >= 4.48 checks the choice and updates every sub-config
        setter(to)
    else:
        cfg._attn_implementation = to
    return {"config._attn_implementation": f"{old} -> {to}"}


def _set_attn_code(names, to: str | None = None, **_: Any) -> str:
    m = names.model
    if to is not None:
        resolve_attn(None, to)  # the same check as apply
        choice = f'"{to}"'
        head = f"# Attention in {to}."
    else:
        choice = "_attn"
        head = ("# eager applies Gemma 2's attention softcapping; sdpa runs on every GPU (FlashAttention needs\n"
                "# compute capability 8.0).\n"
                f'_softcap = getattr({m}.config.get_text_config(), "attn_logit_softcapping", None)\n'
                '_attn = "eager" if _softcap is not None else "sdpa"')
    return f"""{head}
if hasattr({m}, "set_attn_implementation"):
    {m}.set_attn_implementation({choice})
else:  # older transformers: set it on the config before the next forward
    {m}.config._attn_implementation = {choice}
"""


def _set_attn_plan(step: CapturedStep, to: str | None = None, **_: Any) -> ShadowPlan:
    """The attention implementation on every config the model reads it from, for the run only."""
    chosen = resolve_attn(step.eager, to)
    plan = ShadowPlan()
    for path, cfg in model_configs(step.eager):
        old = getattr(cfg, "_attn_implementation", None)
        if old != chosen:
            plan.attributes.append((cfg, "_attn_implementation", chosen))
            plan.changes[f"{path}._attn_implementation"] = f"{old} -> {chosen}"
    return plan


register(Fix("set-attn-implementation", "Switch the attention implementation",
             "Use eager attention for softcapped models (Gemma 2), sdpa otherwise (or to='eager'/'sdpa').",
             _set_attn, _set_attn_code, plan=_set_attn_plan))


# ---- resize-token-embeddings ------------------------------------------------------------------
def _vocab_size(target, num_tokens: int | None) -> int:
    if num_tokens is not None:
        if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens <= 0:
            raise ValueError(f"num_tokens must be a positive int (len(tokenizer)); got {num_tokens!r}")
        return num_tokens
    # fixes.apply already fills target.tokenizer from tokenizer=, or the trainer's processing_class.
    if target.tokenizer is None or not hasattr(target.tokenizer, "__len__"):
        raise ValueError("resize-token-embeddings needs num_tokens=len(tokenizer), tokenizer=, or trainer= with "
                         "its tokenizer as processing_class")
    return len(target.tokenizer)


def _resize(target, num_tokens: int | None = None, **_: Any) -> dict:
    model = target.model
    if not callable(getattr(model, "resize_token_embeddings", None)):
        raise ValueError(f"resize-token-embeddings needs a transformers model; {type(model).__name__} cannot resize")
    size = _vocab_size(target, num_tokens)
    shape = embedding_shape(model)
    if shape is not None and shape[0] >= size:
        return {}  # never shrink: rows beyond the tokenizer may be padding the checkpoint relies on
    old = shape[0] if shape else None
    model.resize_token_embeddings(size, mean_resizing=True)
    return {"embedding_rows": f"{old} -> {size}"}


def _resize_code(names, num_tokens: int | None = None, **_: Any) -> str:
    """``names.tokenizer`` is the user's tokenizer (the trainer's processing_class when only a trainer is named)."""
    m = names.model
    size = repr(num_tokens) if num_tokens is not None else f"len({names.tokenizer})"
    return f"""# Give every token of the tokenizer an embedding row; new rows start at the mean of the trained
# rows (mean_resizing), not at random or zero values.
_size = {size}
if {m}.get_input_embeddings().weight.shape[0] < _size:
    {m}.resize_token_embeddings(_size, mean_resizing=True)
"""


register(Fix("resize-token-embeddings", "Resize the embeddings to the tokenizer",
             "model.resize_token_embeddings(len(tokenizer), mean_resizing=True) when the tokenizer has more tokens "
             "than the embedding has rows.",
             _resize, _resize_code))


# ---- untie-embeddings -------------------------------------------------------------------------
def _input_embedding_weight(model: Any) -> Any:
    getter = getattr(model, "get_input_embeddings", None)
    emb = getter() if callable(getter) else None
    inner = next((m for m in emb.modules() if isinstance(m, torch.nn.Embedding)), None) if emb is not None else None
    if inner is None:
        raise ValueError(f"untie-embeddings needs a model with input embeddings; {type(model).__name__} has none")
    return inner.weight


def _untie(target, **_: Any) -> dict:
    model = target.model
    weight = _input_embedding_weight(model)
    changed: dict = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and module.weight is weight:
            module.weight = torch.nn.Parameter(weight.detach().clone(), requires_grad=weight.requires_grad)
            changed[f"{name}.weight"] = "own copy of the input embeddings"
    for path, cfg in model_configs(model):
        if getattr(cfg, "tie_word_embeddings", False):
            cfg.tie_word_embeddings = False
            changed[f"{path}.tie_word_embeddings"] = "True -> False"
    return changed


def _untie_code(names, **_: Any) -> str:
    m = names.model
    return f"""import torch

# Give the output head its own copy of the tied embedding matrix, so an adapter on one side no longer
# changes the other (merging, saving, reloading). Costs one more vocab x hidden matrix of memory.
_emb = next(x for x in {m}.get_input_embeddings().modules() if isinstance(x, torch.nn.Embedding))
for _name, _module in {m}.named_modules():
    if isinstance(_module, torch.nn.Linear) and _module.weight is _emb.weight:
        _module.weight = torch.nn.Parameter(_emb.weight.detach().clone(), requires_grad=_emb.weight.requires_grad)
{m}.config.tie_word_embeddings = False
{m}.config.get_text_config().tie_word_embeddings = False
"""


register(Fix("untie-embeddings", "Untie the input and output embeddings",
             "Give the output head its own copy of the tied embedding matrix and set tie_word_embeddings=False, "
             "so an adapter on one side of the pair stays on that side.",
             _untie, _untie_code))
