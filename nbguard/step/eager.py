"""The user's model behind its wrappers (torch.compile, DDP, Fabric) and its names without them; replays and
shadow steps run the eager model, so every hook fires."""
from __future__ import annotations

import contextlib

import torch

# Segments a wrapper puts inside a model's names, never the user's own: torch.compile's (at the top, or
# under a compiled block), FSDP1's and torch's activation-checkpoint wrapper's (around each wrapped block)
_WRAPPER_SEGMENTS = ("_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")


def _wrapped_inside(module: torch.nn.Module) -> tuple[torch.nn.Module, str] | None:
    """The module a framework's wrapper holds and the attribute it is under, or None."""
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    inner = getattr(module, "_orig_mod", None)  # torch.compile's OptimizedModule
    if isinstance(inner, torch.nn.Module):
        return inner, "_orig_mod"
    if isinstance(module, (DistributedDataParallel, DataParallel)):
        return module.module, "module"
    inner = getattr(module, "_forward_module", None)  # Lightning Fabric's _FabricModule (by name: no import)
    if type(module).__name__ == "_FabricModule" and isinstance(inner, torch.nn.Module):
        return inner, "_forward_module"
    return None


def unwrap_wrappers(module: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    """The user's model inside the wrappers around it (``torch.compile``, DDP, DataParallel, Fabric's
    module) and the name prefix it has in them (``_forward_module.module.``)."""
    prefix = ""
    for _ in range(8):
        found = _wrapped_inside(module)
        if found is None:
            break
        module, attribute = found
        prefix += attribute + "."
    return module, prefix


def user_module(target: torch.nn.Module) -> torch.nn.Module:
    """What the watch hooks: the user's module inside DDP and Fabric (a replay through DDP would start
    collectives on one rank only; Fabric's wrapper casts inputs before its inner module sees them), but
    still the compiled wrapper (it is what runs the user's forward)."""
    for _ in range(8):
        found = _wrapped_inside(target)
        if found is None or found[1] == "_orig_mod":
            break
        target = found[0]
    return target


unwrap_compiled = unwrap_wrappers  # (the name its first callers know it by: torch.compile's was the first wrapper)


def eager_name(name: str) -> str:
    """A module or parameter name as the user wrote the model, without any wrapper's segment
    (``_orig_mod.model.layers.1`` -> ``model.layers.1``, ``_forward_module.transformer.h.1.mlp`` ->
    ``transformer.h.1.mlp``, ``layers.0._checkpoint_wrapped_module.mlp`` -> ``layers.0.mlp``), so events,
    cells, the heatmap and reports speak of the model the user built. Used for every name nbguard shows."""
    parts = name.split(".")
    while parts and parts[0] == "_forward_module":  # Fabric's, at the top only (an inner one may be the user's)
        parts = parts[1:]
    return ".".join(p for p in parts if p not in _WRAPPER_SEGMENTS)


@contextlib.contextmanager
def eager_everywhere():
    """Functions compiled with ``torch.compile`` and called inside ``forward`` run eagerly too, not
    only a compiled top-level module: every hook fires and no recompilation is triggered."""
    set_stance = getattr(torch.compiler, "set_stance", None)  # torch >= 2.6
    if set_stance is None:
        yield
        return
    with set_stance("force_eager"):
        yield
