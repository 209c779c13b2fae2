"""One-click fixes: each applies in the kernel and renders as the equivalent notebook cell.

    >>> import nbguard.fixes
    >>> nbguard.fixes.apply("upcast-trainable-fp32", model=model)   # change it now
    >>> print(nbguard.fixes.code("upcast-trainable-fp32", model="my_model"))  # the cell to keep

``apply`` is idempotent (a second call reports nothing changed) and records itself in the session
for ``nbguard.report()``. ``code`` writes plain torch/transformers code with the caller's names.
"""
from __future__ import annotations

from typing import Any

from ..introspect.tokenizers import tokenizer_of
from ..session import record_fix
from ..step.targets import resolve_targets
from . import (  # noqa: F401  (registers the fixes)
    config_fixes,
    data_fixes,
    export_fixes,
    model_fixes,
    moe_fixes,
    optimizer_fixes,
    quantized_fixes,
    rl_fixes,
    sampling_fixes,
    setup_fixes,
    trainer_fixes,
    truncation_fixes,
    unsloth_fixes,
)
from .parts import has
from .refusal import FixNotEnough, refusal
from .registry import FIXES, Fix, Names, Target
from .result import FixResult

_NAME_KEYS = ("model", "trainer", "args", "tokenizer", "optimizer", "scaler")


def available() -> list[str]:
    """The ids of every registered fix."""
    return sorted(FIXES)


def get(fix_id: str) -> Fix:
    if not isinstance(fix_id, str) or fix_id not in FIXES:
        raise ValueError(f"unknown fix id {fix_id!r}; valid ids: {', '.join(available())}")
    return FIXES[fix_id]


def check_offered(fix_ids: list[str], offered_by: str) -> list[str]:
    """``fix_ids`` when every one is a registered fix; else a ValueError naming ``offered_by`` (a rule, a signature)."""
    unknown = [fix_id for fix_id in fix_ids if fix_id not in FIXES]
    if unknown:
        raise ValueError(f"{offered_by} offers {', '.join(map(repr, unknown))}, which is not a registered fix: "
                         "register it in nbguard.fixes (register(Fix(...)) with apply and code) or stop offering it")
    return list(fix_ids)


def _check_name(key: str, value: Any) -> str:
    parts = value.split(".") if isinstance(value, str) else []
    if not parts or not all(p.isidentifier() for p in parts):
        raise ValueError(f"{key} must be a variable name (or dotted attribute) such as 'my_model'; got {value!r}")
    return value


def _names(names: dict[str, Any]) -> Names:
    for key, value in names.items():
        _check_name(key, value)
    trainer = names.get("trainer")
    return Names(
        model=names.get("model") or (f"{trainer}.model" if trainer else "model"),
        trainer=trainer,
        args=names.get("args") or (f"{trainer}.args" if trainer else None),
        tokenizer=names.get("tokenizer") or (f"{trainer}.processing_class" if trainer else "tokenizer"),
        optimizer=names.get("optimizer") or (f"{trainer}.optimizer" if trainer else None),
        scaler=names.get("scaler"),
    )


def code(fix_id: str, **names_and_options: Any) -> str:
    """The notebook cell for ``fix_id`` using the caller's variable names (model=, trainer=, args=)."""
    fix = get(fix_id)
    names = {k: v for k, v in names_and_options.items() if k in _NAME_KEYS and v is not None}
    options = {k: v for k, v in names_and_options.items() if k not in _NAME_KEYS}
    resolved = _names(names)
    if fix.needs == "args" and resolved.args is None:
        raise ValueError(f"fix {fix_id!r} changes TrainingArguments: pass trainer= or args= with your variable name")
    if fix.needs == "trainer" and resolved.trainer is None:
        raise ValueError(f"fix {fix_id!r} changes the Trainer: pass trainer= with your variable name")
    if fix.needs == "optimizer" and resolved.optimizer is None:
        raise ValueError(f"fix {fix_id!r} changes the optimizer: pass optimizer= with your variable name")
    if fix.needs == "args-or-optimizer" and resolved.args is None and resolved.optimizer is None:
        raise ValueError(f"fix {fix_id!r} changes TrainingArguments or a plain loop's optimizer: pass trainer=, "
                         "args= or optimizer= with your variable name")
    return fix.code(resolved, **options)


def _target(fix: Fix, model, trainer, args, tokenizer=None, optimizer=None, scaler=None) -> Target:
    model, args, _ = resolve_targets(trainer, model, args)
    if tokenizer is None and trainer is not None:
        tokenizer = tokenizer_of(trainer)
    if optimizer is None and trainer is not None:
        optimizer = getattr(trainer, "optimizer", None)
    if optimizer is not None and not callable(getattr(optimizer, "step", None)):
        raise TypeError(f"optimizer= must be a torch optimizer (torch.optim.Optimizer); got {type(optimizer).__name__}")
    given = {key for key, value in (("model", model), ("args", args), ("trainer", trainer), ("optimizer", optimizer))
             if value is not None}
    if fix.needs == "tokenizer":  # a trainer reaches one only through its processing_class, resolved above
        given = {"tokenizer"} if hasattr(tokenizer, "pad_token_id") else set()
    target = Target(model=model, trainer=trainer, args=args, tokenizer=tokenizer, optimizer=optimizer, scaler=scaler)
    if not fix.reached_by(given):
        got = f"; got {type(tokenizer).__name__}" if fix.needs == "tokenizer" and tokenizer is not None else \
            f"; you gave {has(target)}"
        raise ValueError(f"fix {fix.id!r} needs {fix.need.keywords}{got}")
    return target


def apply(fix_id: str, *, model=None, trainer=None, names: dict[str, str] | None = None, force: bool = False,
          **options: Any) -> FixResult:
    """Apply ``fix_id`` in place; the result says what changed (nothing, when already applied).

    ``names`` are the caller's variable names for what it passed (``{"model": "my_model"}``): the
    recorded cell then reruns as is in the caller's notebook. A cell this session ran on the failing step
    and found "not enough" is refused (``FixNotEnough`` says why and what to make instead) unless ``force``.
    """
    fix = get(fix_id)
    args = options.pop("args", None)
    tokenizer = options.pop("tokenizer", None)
    optimizer, scaler = options.pop("optimizer", None), options.pop("scaler", None)
    target = _target(fix, model, trainer, args, tokenizer, optimizer, scaler)
    given = {key: value for key, value in (("model", model), ("trainer", trainer), ("args", args),
                                           ("tokenizer", tokenizer), ("optimizer", optimizer), ("scaler", scaler))
             if value is not None}
    if names is not None and not isinstance(names, dict):
        raise TypeError(f"names must be a dict such as {{'model': 'my_model'}}, got {type(names).__name__}")
    users = {key: name for key, name in (names or {}).items() if key in given}
    # The recorded cell names what apply was given, so it has the same reach as the action.
    if trainer is not None:
        names = {"trainer": users.get("trainer", "trainer")}
    else:
        names = {key: users.get(key, key) for key in ("model", "args", "optimizer", "scaler") if key in given}
    if tokenizer is not None:
        names["tokenizer"] = users.get("tokenizer", "tokenizer")
    cell = code(fix_id, **names, **options)
    refused = None if force else refusal(fix_id, cell)
    if refused is not None:
        raise FixNotEnough(refused)
    changed = fix.apply(target, **options)
    record_fix(fix_id, changed, cell)
    return FixResult(fix=fix_id, changed=changed, code=cell)


__all__ = ["FIXES", "Fix", "FixNotEnough", "FixResult", "apply", "available", "check_offered", "code", "get"]
