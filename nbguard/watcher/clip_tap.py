"""While a watch is attached, torch's gradient clipping lets it read the gradients first.

HF Trainer (through ``accelerator.clip_grad_norm_``, which unscales and then calls
``torch.nn.utils.clip_grad_norm_``) and many loops clip before the optimizer step. One NaN makes the
clip factor NaN and poisons every gradient, hiding the culprit, so the sentinel must take its
per-group norms before the clip scales anything. One wrapper per clipping function, installed
once for all attached watches (never stacked) and removed when the last one detaches.
"""
from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.utils
import torch.nn.utils.clip_grad

# (module, attribute) of every public function that scales gradients by a norm
_TARGETS = ((torch.nn.utils, "clip_grad_norm_"), (torch.nn.utils.clip_grad, "clip_grad_norm_"),
            (torch.nn.utils, "clip_grads_with_norm_"))
_MARK = "__nbguard_clip_tap__"


class ClipReader(Protocol):
    def before_clip(self, parameters: list[torch.Tensor]) -> None: ...


_READERS: weakref.WeakSet[Any] = weakref.WeakSet()


def _tapped(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def clip(parameters: Any, *args: Any, **kwargs: Any) -> Any:
        if _READERS:
            # a generator can be walked once: hand the same list to the readers and to torch
            listed = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
            parameters = listed
            for reader in list(_READERS):
                reader.before_clip(listed)  # guarded by the reader: it never raises into the user's step
        return original(parameters, *args, **kwargs)

    setattr(clip, _MARK, original)
    return clip


def tap(reader: ClipReader) -> None:
    """``reader.before_clip(parameters)`` runs before every gradient clip from now on."""
    _READERS.add(reader)
    for module, name in _TARGETS:
        current = getattr(module, name, None)
        if current is not None and not hasattr(current, _MARK):
            setattr(module, name, _tapped(current))


def untap(reader: ClipReader) -> None:
    """Stop calling ``reader``; the last reader gone puts torch's own functions back (unless
    something wrapped them after us: then ours stays inside, calling nobody)."""
    _READERS.discard(reader)
    if _READERS:
        return
    for module, name in _TARGETS:
        current = getattr(module, name, None)
        original = getattr(current, _MARK, None)
        if original is not None:
            setattr(module, name, original)


def tapped() -> bool:
    """Whether any clipping function is wrapped now (tests check detach undoes it)."""
    return any(hasattr(getattr(module, name, None), _MARK) for module, name in _TARGETS)
