"""Which fast kernels a transformers model's layers fall back from: the pure-PyTorch paths it runs instead.

Linear-attention and state-space layers (Qwen3-Next's and Qwen3.5's gated DeltaNet, Mamba, Mamba2,
Falcon-H1, Jamba, Bamba, Zamba, NemotronH, LFM2...) call their kernels through functions that transformers
wraps with ``use_kernel_func_from_hub_with_fallback(func_name, package)``: when the modeling module is
imported it tries ``package`` (``fla``, ``causal_conv1d``, ``mamba_ssm``) and, where that import fails, keeps
the model's own reference PyTorch function (correct, much slower: a token-by-token recurrence or a plain
conv1d). The decision is made once, at import, and kept in the wrapper's closure; it is read here as
transformers made it, from the modeling modules of the model's own classes.
"""
from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass
from typing import Any

# import name -> the distribution to install, where they differ
DISTRIBUTIONS = {"fla": "flash-linear-attention", "causal_conv1d": "causal-conv1d", "mamba_ssm": "mamba-ssm"}
_CLOSURE = ("is_new_implementation", "package", "func_name")


@dataclass(frozen=True)
class Fallback:
    """One kernel function a modeling module runs in its reference PyTorch form."""

    module: str  # the modeling module (transformers.models.qwen3_next.modeling_qwen3_next)
    function: str  # the kernel's name in its package (chunk_gated_delta_rule)
    package: str  # the import name transformers tried (fla)
    name: str  # the wrapper's name in the modeling module (torch_chunk_gated_delta_rule)

    @property
    def distribution(self) -> str:
        return DISTRIBUTIONS.get(self.package, self.package.replace("_", "-"))


def _wrapper_facts(obj: Any) -> dict[str, Any] | None:
    """The closure of a ``use_kernel_func_from_hub_with_fallback`` wrapper (followed through ``__wrapped__``)."""
    for _ in range(4):
        code = getattr(obj, "__code__", None)
        closure = getattr(obj, "__closure__", None)
        if code is not None and closure and all(name in code.co_freevars for name in _CLOSURE):
            try:
                cells = dict(zip(code.co_freevars, (cell.cell_contents for cell in closure)))
            except ValueError:  # an empty cell: not the wrapper we know
                return None
            return {name: cells[name] for name in _CLOSURE}
        obj = getattr(obj, "__wrapped__", None)
        if obj is None:
            return None
    return None


def module_fallbacks(module_name: str) -> list[Fallback]:
    """The kernel wrappers of one imported modeling module that run their PyTorch reference."""
    module = sys.modules.get(module_name)
    if module is None:
        return []
    found = []
    for name, obj in list(vars(module).items()):
        if not callable(obj) or isinstance(obj, type):
            continue
        facts = _wrapper_facts(obj)
        if facts is not None and facts["is_new_implementation"] is False:
            found.append(Fallback(module_name, str(facts["func_name"]), str(facts["package"]), name))
    return sorted(set(found), key=lambda f: (f.package, f.function))


def _calls(cls: type, names: set[str]) -> bool:
    """Whether the class's __init__ or forward names one of the module-level wrappers."""
    for method in ("__init__", "forward"):
        func = cls.__dict__.get(method)
        try:
            func = inspect.unwrap(func) if func is not None else None  # forward is often decorated
        except ValueError:
            continue
        code = getattr(func, "__code__", None)
        if code is not None and names & set(code.co_names):
            return True
    return False


def kernel_fallbacks(model: Any) -> tuple[list[Fallback], list[str]]:
    """Every fast kernel the model's layers fall back from, and the layer classes that hold them."""
    modules: dict[str, set[str]] = {}
    for sub in model.modules():
        name = type(sub).__module__
        if name.startswith("transformers.models."):
            modules.setdefault(name, set()).add(type(sub).__name__)
    fallbacks: list[Fallback] = []
    layers: set[str] = set()
    for name, classes in modules.items():
        found = module_fallbacks(name)
        if found:
            fallbacks += found
            wrappers = {f.name for f in found}
            module = sys.modules[name]
            layers |= {c for c in classes if isinstance(getattr(module, c, None), type)
                       and _calls(getattr(module, c), wrappers)}
    return fallbacks, sorted(layers)
