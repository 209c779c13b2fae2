"""Gradient accumulation and the loss normalisation of transformers >= 4.46 (``num_items_in_batch``).

Since 4.46 the Trainer counts the supervised tokens of all the micro-batches of an optimizer step
and hands the count to whoever computes the loss (the model's forward when it takes ``**kwargs``,
``compute_loss_func``, or a ``compute_loss`` override), which must divide the summed loss by it.
The Trainer then does NOT divide by ``gradient_accumulation_steps`` (``training_step``:
``loss_is_scaled_for_ga``). A loss computer that ignores the count returns a per-micro-batch mean,
the Trainer adds ``gradient_accumulation_steps`` of them, and the logged loss and the gradients are
that many times too large. Which party must normalise is decided exactly as ``training_step`` does;
whether it does is read from its bytecode (does it read ``num_items_in_batch`` or pass ``**kwargs`` on).
"""
from __future__ import annotations

import dis
import inspect
import types
from collections.abc import Callable
from typing import Any

from ..registry import finding, rule

_LOADS = {"LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_DEREF", "LOAD_FAST_LOAD_FAST", "LOAD_FAST_BORROW",
          "LOAD_FAST_BORROW_LOAD_FAST_BORROW", "LOAD_CLOSURE"}


def _code_reads(code: types.CodeType, names: set[str]) -> bool:
    for ins in dis.get_instructions(code):
        if ins.opname in _LOADS:
            values = ins.argval if isinstance(ins.argval, tuple) else (ins.argval,)
            if names & set(values):
                return True
    # nested functions and comprehensions see the parameter through a cell
    return any(isinstance(c, types.CodeType) and _code_reads(c, names) for c in code.co_consts)


def passes_num_items(func: Callable) -> bool | None:
    """Whether ``func`` uses ``num_items_in_batch`` (reads it, or passes its ``**kwargs`` on); None if unknown."""
    func = inspect.unwrap(getattr(func, "__func__", func))
    code = getattr(func, "__code__", None)
    if code is None:
        return None
    try:
        params = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):
        return None
    names = {"num_items_in_batch"} | {p.name for p in params if p.kind == inspect.Parameter.VAR_KEYWORD}
    return _code_reads(code, names)


def accepts_num_items(func: Callable) -> bool:
    """Whether ``func(..., num_items_in_batch=...)`` can be called at all."""
    try:
        params = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.name == "num_items_in_batch" or p.kind == inspect.Parameter.VAR_KEYWORD for p in params)


def _qualname(func: Any) -> str:
    func = getattr(func, "__func__", func)
    return f"{getattr(func, '__module__', '?')}.{getattr(func, '__qualname__', repr(func))}"


def _from_transformers(func: Any) -> bool:
    return str(getattr(getattr(func, "__func__", func), "__module__", "")).startswith("transformers.")


def _unwrapped_model(trainer: Any) -> Any:
    model = trainer.model
    accelerator = getattr(trainer, "accelerator", None)
    if accelerator is not None:
        model = accelerator.unwrap_model(model)
    get_base = getattr(model, "get_base_model", None)  # PEFT
    return get_base() if callable(get_base) else model


def _reads_scaled_flag(trainer: Any) -> bool:
    """Whether this transformers Trainer reads ``loss_is_scaled_for_ga`` (5.19+); older ones ignore the attribute."""
    return any(c.__module__.startswith("transformers.") and "loss_is_scaled_for_ga" in vars(c)
               for c in type(trainer).__mro__)


def loss_normaliser(trainer: Any, labels_counted: bool = True) -> tuple[str, Callable] | None:
    """Who must divide by ``num_items_in_batch`` under this Trainer, as (role, function); None: nobody needs to.

    Mirrors ``Trainer.training_step``: the count exists when the batches carry labels and the model takes loss
    kwargs (or ``compute_loss_func`` is set). A trainer class that sets ``loss_is_scaled_for_ga`` itself (TRL's
    GRPO, RLOO, KTO) has declared how its loss is scaled and is trusted.
    """
    if _reads_scaled_flag(trainer) and getattr(trainer, "loss_is_scaled_for_ga", None) is not None:
        return None
    if trainer.compute_loss_func is not None:
        return "compute_loss_func", trainer.compute_loss_func
    if not (getattr(trainer, "model_accepts_loss_kwargs", False) and labels_counted):
        return None  # no count: training_step divides by the accumulation steps itself
    compute_loss = type(trainer).compute_loss
    if not _from_transformers(compute_loss) or "compute_loss" in vars(trainer):
        return "compute_loss", trainer.compute_loss
    return "model.forward", _unwrapped_model(trainer).forward


def _old_signature(trainer: Any) -> Callable | None:
    """A compute_loss override the Trainer cannot call: it passes num_items_in_batch= on every step."""
    compute_loss = trainer.compute_loss
    if _from_transformers(compute_loss) or accepts_num_items(compute_loss):
        return None
    return compute_loss


@rule("accumulation-loss-scale", "warning")
def accumulation_loss_scale(ctx):
    """Gradient accumulation with a loss that ignores num_items_in_batch: logged loss and gradients x accumulation steps."""
    trainer, args = ctx.trainer, ctx.args
    if trainer is None or not hasattr(trainer, "compute_loss_func"):  # transformers < 4.46 has no count at all
        return None
    steps = getattr(args, "gradient_accumulation_steps", 1) if args is not None else 1
    old = _old_signature(trainer)
    if old is not None:
        return finding(
            "accumulation-loss-scale",
            "compute_loss does not accept num_items_in_batch: train() will raise TypeError",
            f"The Trainer calls compute_loss(model, inputs, num_items_in_batch=...) on every step; {_qualname(old)} has "
            "no such parameter and no **kwargs. Add num_items_in_batch=None to its signature, and with gradient "
            "accumulation divide the summed loss by it (or set trainer.loss_is_scaled_for_ga = False).",
            {"gradient_accumulation_steps": steps, "function": _qualname(old), "accepts_num_items_in_batch": False},
            severity="error",
        )
    if not isinstance(steps, int) or steps <= 1:
        return None
    # Without labels in the batches the Trainer counts nothing (DPO-style data); unsampled batches count as labelled.
    labels_counted = not ctx.batches or any("labels" in b for b in ctx.batches)
    found = loss_normaliser(trainer, labels_counted)
    if found is None:
        return None
    role, func = found
    if role == "model.forward" and (_from_transformers(func) or getattr(_unwrapped_model(trainer),
                                                                        "accepts_loss_kwargs", None) is not None):
        return None  # transformers' own models divide by it; a model that declares accepts_loss_kwargs is trusted
    if passes_num_items(func) is not False:
        return None
    return finding(
        "accumulation-loss-scale",
        f"the loss ignores num_items_in_batch: logged loss and gradients are {steps}x too large",
        f"With gradient_accumulation_steps={steps} the Trainer counts the step's supervised tokens, passes the count "
        f"as num_items_in_batch and, trusting {role} to divide by it, does not divide by the accumulation steps. "
        f"{_qualname(func)} never reads it, so each micro-batch loss is a mean and the step adds {steps} of them: the "
        f"logged loss is {steps}x the real one and so are the gradients (clipping and plain SGD see the difference). "
        "Divide the summed loss by num_items_in_batch, or set trainer.loss_is_scaled_for_ga = False.",
        {"gradient_accumulation_steps": steps, "normaliser": role, "function": _qualname(func),
         "model_accepts_loss_kwargs": getattr(trainer, "model_accepts_loss_kwargs", None),
         "loss_is_scaled_for_ga": getattr(trainer, "loss_is_scaled_for_ga", None), "reads_num_items_in_batch": False},
        fixes=["scale-loss-for-accumulation"],
    )
