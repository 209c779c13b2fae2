"""While a watch is attached, torch's gradient clipping lets it read the gradients first.

HF Trainer (through ``accelerator.clip_grad_norm_``, which unscales and then calls
``torch.nn.utils.clip_grad_norm_``) and many loops clip before the optimizer step. One NaN makes the
clip factor NaN and poisons every gradient, hiding the culprit, so the sentinel must take its
per-group norms before the clip scales anything. One patch per clipping function
(``integrations/instance_wrap.py``), installed once for all attached watches and removed when the
last one detaches.

Where the clip is ``clip_grad_norm_`` with its defaults (2-norm, ``error_if_nonfinite=False``,
``foreach=None``) on torch >= 2.6, the wrapper takes the per-tensor norms once for both: it computes
them as torch's ``get_total_norm`` does (one ``_foreach_norm`` per device and dtype, in torch's
grouping order), hands them to the readers that read this step's gradients here, derives the total
norm from them exactly as torch does and clips with torch's own ``clip_grads_with_norm_``. The
returned norm and the clipped gradients are bit-identical to torch's ``clip_grad_norm_``; every
other call (another norm type, ``error_if_nonfinite``, ``foreach`` given, an older torch) goes to
torch's own function after the readers took their own norms.
"""
from __future__ import annotations

import weakref
from typing import Any, Protocol

import torch
import torch.nn.utils
import torch.nn.utils.clip_grad

from ..core.guard import UserCall, guarded_call, warn_failure
from ..integrations.instance_wrap import Patch, find_patch, is_patched, patch, unpatched

try:  # torch >= 2.6: clip_grad_norm_ is _get_total_norm followed by this (the untapped original)
    from torch.nn.utils.clip_grad import _clip_grads_with_norm_ as _clip_with_norm
    from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype, _has_foreach_support
except ImportError:  # pragma: no cover - older torch: the readers take their own norms
    _clip_with_norm = None  # type: ignore[assignment]

# (module, attribute) of every public function that clips gradients in place (by a norm, or by value:
# a clamp turns an inf into a finite number, so the read must come first)
_TARGETS = ((torch.nn.utils, "clip_grad_norm_"), (torch.nn.utils.clip_grad, "clip_grad_norm_"),
            (torch.nn.utils, "clip_grads_with_norm_"), (torch.nn.utils, "clip_grad_value_"),
            (torch.nn.utils.clip_grad, "clip_grad_value_"))
# torch's own clip_grad_norm_: only a call to it is computed here (never bypass another library's wrapper)
_TORCH_NORM_CLIP = unpatched(torch.nn.utils.clip_grad.clip_grad_norm_)

# (device, dtype, how many) per group of torch's _foreach_norm, in the order the norms are stacked
Kinds = tuple[tuple[torch.device, torch.dtype, int], ...]


class ClipReader(Protocol):
    def before_clip(self, parameters: list[torch.Tensor]) -> None: ...

    def shares_clip(self, parameters: list[torch.Tensor]) -> bool: ...

    def take_from_clip(self, parameters: list[torch.Tensor], kinds: Kinds, norms: torch.Tensor) -> None: ...


# id(reader) -> the reader, weakly (a watch dropped without detach reads nothing). A dict of weak
# references rather than a WeakSet: iterating a WeakSet runs Python code per element, at every clip.
_READERS: dict[int, weakref.ref] = {}


def _live_readers() -> list[Any]:
    return [reader for ref in tuple(_READERS.values()) if (reader := ref()) is not None]


def _max_norm_if_shareable(args: tuple, kwargs: dict) -> Any:
    """``max_norm`` when ``clip_grad_norm_(parameters, *args, **kwargs)`` is a default 2-norm clip, else None."""
    if len(args) > 4:  # (called only where the clip can share: torch >= 2.6)
        return None
    names = ("max_norm", "norm_type", "error_if_nonfinite", "foreach")
    bound = dict(zip(names, args))
    for key, value in kwargs.items():
        if key not in names or key in bound:
            return None  # torch's own function raises its TypeError
        bound[key] = value
    if "max_norm" not in bound or bound.get("error_if_nonfinite") or bound.get("foreach") is not None:
        return None
    try:
        if float(bound.get("norm_type", 2.0)) != 2.0:
            return None
    except (TypeError, ValueError):
        return None
    return bound["max_norm"]


# id(parameter) -> (a weak reference to it, the max_norm it was last clipped to) for every norm clip seen while
# a watch is attached: "the loop already clips" is read here (a fix that already holds is not offered)
_CLIPPED: dict[int, tuple[weakref.ref, float]] = {}


def _note_clip(parameters: list[Any], args: tuple, kwargs: dict) -> None:
    """Remember the max_norm of a norm clip over ``parameters`` by its first tensor (one dict store a step)."""
    max_norm = args[0] if args else kwargs.get("max_norm")
    # a plain number only: float() of a device tensor would sync inside the user's step
    if not parameters or not isinstance(parameters[0], torch.Tensor) or isinstance(max_norm, bool) \
            or not isinstance(max_norm, (int, float)):
        return
    _CLIPPED[id(parameters[0])] = (weakref.ref(parameters[0]), float(max_norm))


def clip_limit(parameters: Any) -> float | None:
    """The largest max_norm a watched loop clipped any of ``parameters`` to (None: never seen clipped)."""
    limits = []
    for p in parameters:
        seen = _CLIPPED.get(id(p))
        if seen is not None and seen[0]() is p:
            limits.append(seen[1])
    return max(limits) if limits else None


def _clip_norms(parameters: list[torch.Tensor]) -> tuple[list[torch.Tensor], Kinds, torch.Tensor, torch.Tensor] | None:
    """What torch's ``clip_grad_norm_(parameters)`` computes before it scales anything: the parameters
    with a gradient in the order of their stacked 2-norms, the norms' groups (``Kinds``), the stacked
    norms and the total norm. None where there is no gradient (torch's own call then runs)."""
    with torch.no_grad():
        with_grad = [p for p in parameters if p.grad is not None]
        if not with_grad:
            return None
        grads: list[torch.Tensor] = [p.grad for p in with_grad]  # type: ignore[misc]
        # as torch.nn.utils.get_total_norm(grads, 2.0): the same grouping, kernels and order
        grouped = _group_tensors_by_device_and_dtype([grads], with_indices=True)  # type: ignore[list-item]
        norms: list[torch.Tensor] = []
        order: list[int] = []
        kinds = []
        for (device, dtype), ([device_grads], indices) in grouped.items():
            if _has_foreach_support(device_grads, device):  # type: ignore[arg-type]
                norms.extend(torch._foreach_norm(device_grads, 2.0))  # type: ignore[arg-type]
            else:
                norms.extend([torch.linalg.vector_norm(g, 2.0) for g in device_grads])
            order.extend(indices)
            kinds.append((device, dtype, len(indices)))
        first_device = grads[0].device
        stacked = torch.stack([norm.to(first_device) for norm in norms])
        total_norm = torch.linalg.vector_norm(stacked, 2.0)
    return [with_grad[i] for i in order], tuple(kinds), stacked, total_norm


class _ClipTap:
    """nbguard's part around one clipping function (the around of its patch)."""

    def __init__(self, by_norm: bool):
        self.by_norm = by_norm
        self.patch: Patch | None = None

    def __call__(self, call: UserCall, parameters: Any, *args: Any, **kwargs: Any) -> Any:
        if not _READERS:
            return call(parameters, *args, **kwargs)
        # a generator can be walked once: hand the same list to the readers and to torch
        listed = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        # only a call to torch's own clip_grad_norm_ is computed here (never bypass another library's wrapper)
        shares = self.patch is not None and self.patch.inner is _TORCH_NORM_CLIP and _clip_with_norm is not None
        # the readers' part, guarded here rather than by the patch: a failure after the list was taken
        # must still hand torch that list, not the spent generator
        shared = guarded_call(warn_failure, self._read, listed, args, kwargs, shares)
        if shared is None:
            return call(listed, *args, **kwargs)
        max_norm, total_norm = shared
        # torch's own scaling with the norms already taken: its errors are the user's, as torch's clip's would be
        return call.instead(_clip_and_return, listed, max_norm, total_norm)

    def _read(self, listed: list[Any], args: tuple, kwargs: dict, shares: bool) -> tuple[Any, torch.Tensor] | None:
        """Hand the gradients to the readers; (max_norm, total_norm) where they took the clip's own norms
        and the clip is left to finish, None where torch's own call runs."""
        if self.by_norm:
            _note_clip(listed, args, kwargs)
        readers = _live_readers()
        max_norm: Any = None
        if shares:  # (the Trainer's and most loops' call, clip_grad_norm_(parameters, max_norm), first)
            max_norm = args[0] if len(args) == 1 and not kwargs else _max_norm_if_shareable(args, kwargs)
        sharing = [r for r in readers if r.shares_clip(listed)] if max_norm is not None else []
        for reader in readers:
            if reader not in sharing:
                reader.before_clip(listed)  # guarded by the reader: it never raises into the user's step
        if sharing:
            try:
                computed = _clip_norms(listed)
            except Exception:  # nothing is scaled yet: torch's own call runs (and raises its own error)
                computed = None
            if computed is not None:
                ordered, kinds, norms, total_norm = computed
                for reader in sharing:
                    reader.take_from_clip(ordered, kinds, norms)  # guarded by the reader
                return max_norm, total_norm
            for reader in sharing:
                reader.before_clip(listed)
        return None


def _clip_and_return(parameters: list[torch.Tensor], max_norm: Any, total_norm: torch.Tensor) -> torch.Tensor:
    _clip_with_norm(parameters, max_norm, total_norm, None)
    return total_norm


# (module, attribute) -> nbguard's patch there, while any reader is registered
_PATCHES: dict[tuple[Any, str], Patch] = {}


def tap(reader: ClipReader) -> None:
    """``reader.before_clip(parameters)`` runs before every gradient clip from now on (or, for a
    default ``clip_grad_norm_``, ``reader.take_from_clip`` with the clip's own norms)."""
    key = id(reader)

    def gone(_: weakref.ref) -> None:  # the reader was collected without untap
        _READERS.pop(key, None)

    _READERS[key] = weakref.ref(reader, gone)
    for module, name in _TARGETS:
        held = _PATCHES.get((module, name))
        if getattr(module, name, None) is None or (held is not None and find_patch(module, name) is held.site):
            continue  # no such function in this torch, or ours is in force already
        if held is not None:
            held.remove()  # put back by someone else since: start again from what is there now
        around = _ClipTap(by_norm="norm" in name)
        around.patch = _PATCHES[(module, name)] = patch(module, name, around, warn_failure)


def untap(reader: ClipReader) -> None:
    """Stop calling ``reader``; the last reader gone puts torch's own functions back (unless
    something wrapped them after us: then ours stays inside, calling straight through)."""
    if _READERS.get(id(reader), lambda: None)() is reader:
        del _READERS[id(reader)]
    if _READERS:
        return
    for held in _PATCHES.values():
        held.remove()
    _PATCHES.clear()


def tapped() -> bool:
    """Whether any clipping function is wrapped now (tests check detach undoes it)."""
    return any(is_patched(module, name) for module, name in _TARGETS)
