"""Finding the user's objects (trainer, model, optimizer, ...) by name in the notebook namespace.

Magics report problems as one line; :class:`MagicError` carries that line.
"""
from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any


class MagicError(Exception):
    """A user error in a magic's arguments; shown as one ``nbguard: ...`` line, never a traceback."""


def is_trainer(obj: Any) -> bool:
    transformers = sys.modules.get("transformers")
    if transformers is None:
        return False
    try:
        return isinstance(obj, transformers.Trainer)
    except Exception:  # a broken transformers import must not break name lookup
        return False


def is_model(obj: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.nn.Module)


def is_training_args(obj: Any) -> bool:
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(obj, transformers.TrainingArguments)


def is_tokenizer(obj: Any) -> bool:
    transformers = sys.modules.get("transformers")
    base = getattr(transformers, "PreTrainedTokenizerBase", None) if transformers is not None else None
    return base is not None and isinstance(obj, base)


def is_optimizer(obj: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.optim.Optimizer)


def is_scaler(obj: Any) -> bool:
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    classes = tuple(c for c in (getattr(torch.amp, "GradScaler", None), getattr(torch.cuda.amp, "GradScaler", None)) if c)
    return isinstance(obj, classes)


def is_batch(obj: Any) -> bool:
    return isinstance(obj, dict) or hasattr(obj, "keys") and hasattr(obj, "__getitem__")


def lookup(user_ns: dict[str, Any], name: str) -> Any:
    """``name`` or a dotted path (``trainer.model``) in the namespace; MagicError when missing."""
    head, *rest = name.split(".")
    if not head.isidentifier() or not all(part.isidentifier() for part in rest):
        raise MagicError(f"{name!r} is not a variable name")
    if head not in user_ns:
        raise MagicError(f"no variable named {head!r} in the notebook")
    obj = user_ns[head]
    for i, part in enumerate(rest):
        if not hasattr(obj, part):
            raise MagicError(f"{'.'.join([head, *rest[:i]])!r} has no attribute {part!r}")
        obj = getattr(obj, part)
    return obj


def candidates(user_ns: dict[str, Any], predicate: Callable[[Any], bool]) -> dict[str, Any]:
    """Public variables (no leading underscore: IPython's output cache) passing ``predicate``, each object once."""
    found: dict[str, Any] = {}
    seen: set[int] = set()
    for name, obj in list(user_ns.items()):
        if name.startswith("_") or id(obj) in seen:
            continue
        try:
            ok = predicate(obj)
        except Exception:
            ok = False
        if ok:
            seen.add(id(obj))
            found[name] = obj
    return found


def top_level_models(models: dict[str, Any]) -> dict[str, Any]:
    """Drop models that are submodules of another candidate (``head = model.lm_head``)."""
    if len(models) < 2:
        return models
    inner: set[int] = set()
    for obj in models.values():
        for sub in obj.modules():
            if sub is not obj:
                inner.add(id(sub))
    return {name: obj for name, obj in models.items() if id(obj) not in inner}


def name_of(user_ns: dict[str, Any], obj: Any, default: str) -> str:
    """The notebook's name for ``obj`` when it has one, else ``default`` (e.g. ``trainer.model``)."""
    for name, value in user_ns.items():
        if value is obj and not name.startswith("_"):
            return name
    return default


def describe(obj: Any) -> str:
    return type(obj).__name__


def unique(found: dict[str, Any], what: str, hint: str) -> tuple[str, Any] | None:
    """The one candidate, None for none; MagicError listing them when several."""
    if not found:
        return None
    if len(found) > 1:
        listing = ", ".join(f"{n} ({describe(o)})" for n, o in found.items())
        raise MagicError(f"several {what} in the notebook: {listing}; {hint}")
    return next(iter(found.items()))


def _shape(tensor: Any) -> str:
    return "(" + ", ".join(str(d) for d in tensor.shape) + ("," if tensor.dim() == 1 else "") + ")"


def checked_batch(batch: Any, name: str, model: Any = None) -> Any:
    """``batch`` (named ``name`` in the notebook) when the audit and the probe can run on it;
    MagicError naming what is wrong with it and what to do otherwise."""
    from collections.abc import Mapping

    import torch

    where = f"--batch {name!r}"
    if not isinstance(batch, Mapping):
        raise MagicError(f"{where} is a {describe(batch)}, expected a dict of tensors (input_ids, attention_mask, "
                         "labels), e.g. one batch from your collator or tokenizer(..., return_tensors='pt')")
    if not batch:
        raise MagicError(f"{where} is empty; it needs at least 'input_ids'")
    keys = ", ".join(map(repr, batch))
    not_tensors = {key: describe(value) for key, value in batch.items() if not isinstance(value, torch.Tensor)}
    if not_tensors:
        listing = ", ".join(f"{key!r} is a {kind}" for key, kind in not_tensors.items())
        raise MagicError(f"{where} must hold tensors, but {listing}; convert with torch.tensor(...) or have the "
                         "tokenizer/collator return tensors (return_tensors='pt')")
    if "input_ids" not in batch and "inputs_embeds" not in batch:
        raise MagicError(f"{where} has no 'input_ids' (its keys: {keys}); the probe feeds the model input_ids "
                         "(or inputs_embeds)")
    ids = batch.get("input_ids")
    if ids is None:
        return batch
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise MagicError(f"{where}: input_ids is {str(ids.dtype).replace('torch.', '')}; token ids must be an "
                         "integer tensor (.long())")
    if ids.dim() != 2:
        raise MagicError(f"{where}: input_ids has shape {_shape(ids)}; expected (batch, sequence)"
                         + (": add the batch dimension with .unsqueeze(0)" if ids.dim() == 1 else ""))
    for key in ("attention_mask", "labels"):
        value = batch.get(key)
        if isinstance(value, torch.Tensor) and value.shape != ids.shape:
            raise MagicError(f"{where}: {key} has shape {_shape(value)} but input_ids has {_shape(ids)}; they must "
                             "match")
    if ids.numel() and int(ids.min()) < 0:
        raise MagicError(f"{where}: input_ids holds the negative id {int(ids.min())}; -100 belongs in labels only")
    rows = _embedding_rows(model)
    if rows is not None and ids.numel() and int(ids.max()) >= rows:
        raise MagicError(f"{where}: input_ids holds id {int(ids.max())} but the model's input embedding has {rows} "
                         "rows; was the batch made with another tokenizer, or did you add tokens without "
                         "model.resize_token_embeddings(len(tokenizer))?")
    return batch


def _embedding_rows(model: Any) -> int | None:
    """Rows of the model's input embedding, None when the model does not say."""
    try:
        return int(model.get_input_embeddings().num_embeddings)
    except Exception:  # not a transformers model, or no embedding: nothing to compare against
        return None


def optimizes(optimizer: Any, model: Any) -> bool:
    """Whether ``optimizer`` updates at least one parameter of ``model``."""
    params = {id(p) for p in model.parameters()}
    return any(id(p) in params for group in optimizer.param_groups for p in group["params"])
