"""What the failing code really held, read off the exception's traceback.

An exception raised inside a model's forward carries its frames: the innermost ``self`` that is a
``torch.nn.Module`` is the layer that failed (with the tensors it was given), the outermost one is
the model the user called. Reading them tells a dtype mismatch caused by mixed parameter dtypes
from one caused by a 4-bit layer's compute dtype or a model forced to float32. Nothing is kept:
the diagnosis stores plain names and dtypes, never the frames.
"""
from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ModelFacts:
    layer: str | None = None  # class name of the innermost module in the traceback
    layer_name: str | None = None  # its name inside the outermost module
    weight_dtype: str | None = None
    input_dtype: str | None = None
    model: str | None = None  # class name of the outermost module
    param_dtypes: dict[str, int] = field(default_factory=dict)  # floating, non-quantised parameters
    compute_dtypes: dict[str, int] = field(default_factory=dict)  # of bitsandbytes Linear4bit layers
    minority: dict[str, list[str]] = field(default_factory=dict)  # dtype -> every module holding it (not the majority's)


def _dtype(value: Any) -> str:
    return str(value).replace("torch.", "")


def _first_floating_tensor(local_vars: dict[str, Any], torch) -> Any:
    for key in ("input", "x", "hidden_states", "inputs", "inp"):
        value = local_vars.get(key)
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value
    return None


def model_facts(exc: BaseException) -> ModelFacts | None:
    """Facts about the modules in ``exc``'s traceback, or None when it went through no torch module."""
    torch = sys.modules.get("torch")
    if torch is None:  # torch never imported: the error cannot come from a torch module
        return None
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        self_obj = tb.tb_frame.f_locals.get("self")
        if isinstance(self_obj, torch.nn.Module):
            frames.append((self_obj, tb.tb_frame.f_locals))
        tb = tb.tb_next
    if not frames:
        return None
    root = frames[0][0]
    layer, local_vars = frames[-1]
    weight = getattr(layer, "weight", None)
    tensor = _first_floating_tensor(local_vars, torch)
    facts = ModelFacts(
        layer=type(layer).__name__, model=type(root).__name__,
        weight_dtype=_dtype(weight.dtype) if isinstance(weight, torch.Tensor) and weight.is_floating_point() else None,
        input_dtype=_dtype(tensor.dtype) if tensor is not None else None,
    )
    counts: Counter = Counter()
    holders: dict[str, list[str]] = {}
    for name, module in root.named_modules():
        if module is layer:
            facts.layer_name = name or type(root).__name__
        compute = getattr(module, "compute_dtype", None)
        if type(module).__name__ == "Linear4bit" and compute is not None:
            facts.compute_dtypes[_dtype(compute)] = facts.compute_dtypes.get(_dtype(compute), 0) + 1
        for p in module.parameters(recurse=False):
            if p.is_floating_point() and type(p).__name__ != "Params4bit":
                counts[_dtype(p.dtype)] += p.numel()
                holders.setdefault(_dtype(p.dtype), [])
                if name not in holders[_dtype(p.dtype)]:
                    holders[_dtype(p.dtype)].append(name or type(root).__name__)
    facts.param_dtypes = dict(counts)
    if len(counts) > 1:
        majority = counts.most_common(1)[0][0]
        facts.minority = {d: holders[d] for d in counts if d != majority}
    return facts
