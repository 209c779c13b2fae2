"""The eager model behind ``torch.compile``: replays and shadow steps run it, so every hook fires."""
from __future__ import annotations

import contextlib

import torch


def unwrap_compiled(module: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    """The eager module behind ``torch.compile`` and the name prefix it has in the wrapper."""
    prefix = ""
    while hasattr(module, "_orig_mod") and isinstance(module._orig_mod, torch.nn.Module):
        module = module._orig_mod
        prefix += "_orig_mod."
    return module, prefix


def eager_name(name: str) -> str:
    """A module or parameter name as the user wrote the model: ``torch.compile``'s ``_orig_mod.`` prefix
    dropped (``_orig_mod.model.layers.1`` -> ``model.layers.1``), so events, cells, the heatmap and
    reports speak of the model the user built; look such a name up on ``unwrap_compiled(model)[0]``."""
    while name == "_orig_mod" or name.startswith("_orig_mod."):
        name = name[len("_orig_mod."):]
    return name


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
