"""Rules about the KV cache and gradient checkpointing during training."""
from __future__ import annotations

import functools
import inspect
import re
import sys
from typing import Any

import torch

from ...environment import in_release_series
from ...introspect.dtypes import HALF_DTYPES, dtype_name
from ..registry import capped, finding, rule

# Releases whose caches are Cache objects built by the model's forward (their pre-releases and dev
# builds included); the feature checks below decide whether this model's cache really carries a dtype.
CACHE_DTYPE_RELEASES = ("4.50.0", "4.51.0")
_DEFAULT_CACHE = re.compile(r"past_key_values\s*=\s*(\w+Cache)\(")


@functools.cache
def accelerate_converts_dtype_objects() -> bool:
    """Whether accelerate's fp32 output conversion treats any object with a half ``dtype`` as a tensor."""
    try:
        from accelerate.utils.operations import convert_to_fp32
    except Exception:
        return False

    class _CarriesDtype:
        dtype = torch.bfloat16

    try:
        convert_to_fp32(_CarriesDtype())
    except AttributeError:  # it called .float() on it: exactly what happens to the cache
        return True
    except Exception:
        return False
    return False


def _default_cache_classes(model) -> list[type]:
    """The cache classes the model's own forward builds when none is passed (read from its modelling code)."""
    names: set[tuple[str, Any]] = set()  # (class name, the modelling module that builds it)
    modules: set[Any] = set()
    for sub in model.modules():
        mod = sys.modules.get(type(sub).__module__)
        if mod is not None and mod.__name__.startswith("transformers.models.") and mod not in modules:
            modules.add(mod)
            try:
                names.update((n, mod) for n in _DEFAULT_CACHE.findall(inspect.getsource(mod)))
            except (OSError, TypeError):
                continue
    return [getattr(mod, n) for n, mod in names if isinstance(getattr(mod, n, None), type)]


def _cache_carries_dtype(cls: type, config) -> bool:
    attempts = (
        lambda: cls(config=config, max_batch_size=1, max_cache_len=2, device="meta", dtype=torch.bfloat16),
        lambda: cls(config=config),
        lambda: cls(),
    )
    for make in attempts:
        try:
            cache = make()
        except Exception:
            continue
        return isinstance(getattr(cache, "dtype", None), torch.dtype)
    return "self.dtype" in inspect.getsource(vars(cls).get("__init__", cls))


def _embedding_dtype(ctx):
    weight = getattr(ctx.input_embeddings, "weight", None)
    return weight.dtype if isinstance(weight, torch.Tensor) else ctx.weight_dtype


@rule("cache-eval-crash", "error")
def cache_eval_crash(ctx):
    """Evaluation during mixed-precision training returns a cache that accelerate tries to .float()."""
    tf = ctx.version("transformers")
    if ctx.model is None or ctx.args is None or not in_release_series(tf, *CACHE_DTYPE_RELEASES):
        return None
    if not (ctx.use_cache and ctx.mixed_precision and ctx.evaluates_during_training):
        return None
    emb_dtype = _embedding_dtype(ctx)
    if emb_dtype not in HALF_DTYPES or not accelerate_converts_dtype_objects():
        return None
    carrying = [c.__name__ for c in _default_cache_classes(ctx.model) if _cache_carries_dtype(c, ctx.text_config)]
    if not carrying:
        return None
    return finding(
        "cache-eval-crash",
        "evaluation will crash: 'HybridCache' object has no attribute 'float'",
        f"In eval mode with use_cache on, the model's forward returns a {carrying[0]} whose dtype attribute is "
        f"{dtype_name(emb_dtype)} (the dtype of the embeddings). With mixed precision the Trainer's forward is "
        "wrapped by accelerate's convert_to_fp32, which treats anything with a half-precision dtype as a tensor "
        "and calls .float() on it, so the first evaluation during training raises AttributeError. Training "
        "does not need the cache: set use_cache=False.",
        {"transformers": str(tf), "accelerate": str(ctx.version("accelerate")), "cache_classes": carrying,
         "embedding_dtype": dtype_name(emb_dtype), "mixed_precision": ctx.mixed_precision,
         "eval_strategy": ctx.eval_strategy,
         "use_cache": True},
        fixes=["disable-use-cache"],
    )


def _checkpointing_on(ctx) -> bool:
    return bool(ctx.checkpointed_modules) or bool(
        getattr(ctx.args, "gradient_checkpointing", False) or getattr(ctx.args, "activation_checkpointing", False))


@rule("cache-with-checkpointing", "warning")
def cache_with_checkpointing(ctx):
    """use_cache left on with gradient checkpointing."""
    if ctx.model is None or not ctx.use_cache or not _checkpointing_on(ctx):
        return None
    return finding(
        "cache-with-checkpointing",
        "use_cache is on with gradient checkpointing",
        "Gradient checkpointing recomputes each layer in the backward pass; a KV cache filled in the forward "
        "pass is then stale or doubled, so transformers turns the cache off at every step with a warning, and "
        "some models or older releases error instead. Turn use_cache off for training.",
        {"use_cache": True, "checkpointed_modules": len(ctx.checkpointed_modules),
         "args_gradient_checkpointing": bool(getattr(ctx.args, "gradient_checkpointing", False))},
        fixes=["disable-use-cache"],
    )


def _reentrant(module) -> bool:
    func = getattr(module, "_gradient_checkpointing_func", None)
    if isinstance(func, functools.partial):
        return func.keywords.get("use_reentrant", True) is not False
    return func is not None


@functools.cache
def transformers_checkpointing_defaults() -> tuple[bool, bool]:
    """(reentrant by default, hooks the input grads itself) for this transformers, read from its own code.

    Older releases default to ``use_reentrant=True`` and add the input-grad hook only for PEFT loaded
    through transformers; recent ones default to non-reentrant and hook the embeddings of token models.
    """
    try:
        from transformers import PreTrainedModel
    except Exception:
        return True, False
    src = ""
    for name in ("_activation_checkpointing_enable", "activation_checkpointing_enable", "gradient_checkpointing_enable"):
        fn = getattr(PreTrainedModel, name, None)
        try:
            src += inspect.getsource(fn) if fn is not None else ""
        except (OSError, TypeError):
            continue
    default = re.search(r'\{"use_reentrant":\s*(True|False)\}', src)
    return (default is None or default.group(1) == "True"), "needs_embedding_grads" in src


def _checkpointing_to_come(ctx) -> bool:
    """The Trainer will turn checkpointing on at train() (args), reentrant and without the input-grad hook."""
    args = ctx.args
    if ctx.checkpointed_modules or not (getattr(args, "gradient_checkpointing", False)
                                        or getattr(args, "activation_checkpointing", False)):
        return False
    kwargs = getattr(args, "gradient_checkpointing_kwargs", None) or getattr(
        args, "activation_checkpointing_kwargs", None) or {}
    default_reentrant, hooks_itself = transformers_checkpointing_defaults()
    if kwargs.get("use_reentrant", default_reentrant) is False or hooks_itself:
        return False
    return not any(getattr(m, "_hf_peft_config_loaded", False) for _, m in ctx.modules)


@rule("checkpointing-no-input-grads", "error")
def checkpointing_no_input_grads(ctx):
    """Reentrant checkpointing over frozen embeddings: the loss ends up with no grad_fn."""
    if ctx.model is None or not ctx.trainable or ctx.input_grad_hooks:
        return None
    reentrant = [n for n, m in ctx.checkpointed_modules if _reentrant(m)]
    to_come = not reentrant and _checkpointing_to_come(ctx)
    if not reentrant and not to_come:
        return None
    weight = getattr(ctx.input_embeddings, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.requires_grad:
        return None
    evidence = {"use_reentrant": True, "input_embeddings_requires_grad": False, "peft": ctx.is_peft}
    if reentrant:
        evidence["checkpointed_modules"] = capped(reentrant)
    else:
        evidence["enabled_by"] = "args.gradient_checkpointing (the Trainer enables it at train())"
        evidence["transformers"] = str(ctx.version("transformers"))
    return finding(
        "checkpointing-no-input-grads",
        "gradient checkpointing will see inputs that do not require grad",
        "Reentrant gradient checkpointing only records a backward graph when an input of the checkpointed "
        "block requires grad. The embeddings are frozen (PEFT), so the hidden states entering each layer do "
        "not, the adapters inside the layers get no gradient and backward raises \"element 0 of tensors does "
        "not require grad and does not have a grad_fn\". Make the embedding output require grad.",
        evidence,
        fixes=["enable-input-require-grads"],
    )
