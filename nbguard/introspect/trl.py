"""Facts read off TRL's RL and preference trainers (GRPO, RLOO, Online DPO, DPO, KTO), by class
ancestry and attribute, without importing TRL: which family a trainer is, its plain reward
functions, its group size and completion cap. The audit and the watch share them."""
from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from .tokenizers import tokenizer_of

# class name -> family; subclasses count (a user's GRPOTrainer subclass is still GRPO)
_FAMILIES = {"GRPOTrainer": "grpo", "RLOOTrainer": "rloo", "OnlineDPOTrainer": "online-dpo",
             "DPOTrainer": "dpo", "KTOTrainer": "kto"}
GENERATING = ("grpo", "rloo", "online-dpo")  # families that score their own completions with reward functions
PREFERENCE = ("dpo", "kto")  # families whose loss compares chosen and rejected answers under a reference


def trl_stack(trainer: Any) -> str | None:
    """"grpo", "rloo", "online-dpo", "dpo" or "kto" for a TRL trainer (or a subclass), else None."""
    for cls in type(trainer).__mro__:
        if cls.__module__.startswith("trl") and cls.__name__ in _FAMILIES:
            return _FAMILIES[cls.__name__]
    return None


_CONFIGS = {"GRPOConfig": "grpo", "RLOOConfig": "rloo", "OnlineDPOConfig": "online-dpo", "DPOConfig": "dpo",
            "KTOConfig": "kto"}


def config_stack(args: Any) -> str | None:
    """The family of a TRL config (``GRPOConfig`` -> "grpo", subclasses count), else None: what the audit
    knows of a run from its args alone, before any trainer is built."""
    for cls in type(args).__mro__:
        if cls.__module__.startswith("trl") and cls.__name__ in _CONFIGS:
            return _CONFIGS[cls.__name__]
    return None


def _is_module(obj: Any) -> bool:
    import torch

    return isinstance(obj, torch.nn.Module)


def plain_reward_functions(trainer: Any) -> list[tuple[int, str, Callable]]:
    """(index in ``trainer.reward_funcs``, TRL's name for it, the function) for each synchronous
    reward function that is not a reward model: the ones TRL calls as
    ``func(prompts=, completions=, completion_ids=, **columns)``."""
    funcs = getattr(trainer, "reward_funcs", None)
    if not isinstance(funcs, list):
        return []
    names = list(getattr(trainer, "reward_func_names", None) or [])
    out = []
    for i, func in enumerate(funcs):
        if not callable(func) or _is_module(func) or inspect.iscoroutinefunction(func):
            continue
        out.append((i, names[i] if i < len(names) else getattr(func, "__name__", f"reward_{i}"), func))
    return out


def group_size(trainer: Any) -> int | None:
    """Completions generated per prompt (the group GRPO/RLOO take their baseline over)."""
    size = getattr(trainer, "num_generations", None) or getattr(getattr(trainer, "args", None), "num_generations", None)
    return size if isinstance(size, int) else None


def completion_cap(trainer: Any) -> int | None:
    cap = getattr(trainer, "max_completion_length", None) or getattr(
        getattr(trainer, "args", None), "max_completion_length", None)
    return cap if isinstance(cap, int) and cap > 0 else None


def eos_token_id(trainer: Any) -> int | None:
    eos = getattr(tokenizer_of(trainer), "eos_token_id", None)
    return eos if isinstance(eos, int) else None


# The attribute a watch's reward tap keeps the function it calls in (read at every call, so a fix can
# slip a wrapper in under the tap): set on the tap's wrapper, never on the user's function.
TAPPED = "__nbguard_reward__"
