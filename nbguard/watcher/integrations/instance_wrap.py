"""The one way nbguard puts a wrapper on a user's object: ``patch(owner, name, around)``.

``owner`` is whatever holds the callable: an instance (its method; the wrapper is set on the
instance, so the class's own shows through again once removed: an optimizer, a Trainer, DeepSpeed's
engine), a module (a function such as ``torch.nn.utils.clip_grad_norm_``), or a list (``name`` an
index: TRL's reward functions). A class's plain function works too, not its static or class methods
(the wrapper is a plain function, so it would bind).
``around(call, *args, **kwargs)`` is nbguard's part; ``call(*args, **kwargs)`` runs what was there.

- Invisible: accelerate's ``AcceleratedOptimizer.zero_grad`` reads
  ``inspect.signature(optimizer.zero_grad)`` and refuses ``set_to_none`` when the parameter is
  missing, so a ``(*args, **kwargs)`` wrapper broke every accelerate loop. ``functools.wraps`` copies
  the name, docstring and module and sets ``__wrapped__``, which ``inspect.signature`` follows.
- Guarded: every around runs through ``guard.guarded_around``; its failure is reported to its
  ``on_error`` and the user's call still runs once, its result or exception unchanged.
- Found again, never stacked: the wrapper carries ``MARK`` (its site). Patching the same attribute of
  the same owner again adds the new around to that wrapper (the newest outermost) instead of wrapping
  the wrapper; each ``Patch`` removes its own around, in any order, and the last one out restores the
  attribute: the very object that was there, or no instance attribute where it came from the class.
  Where something wrapped ours since, ours stays inside it, calling straight through.
- The slot: the wrapper calls what its attribute ``slot`` holds at each call (``__wrapped__``, the
  original), so a fix can slip a wrapper in under the patch; removal puts that back.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from ..core.guard import OnError, guarded_around, warn_failure

MARK = "__nbguard__"  # on every wrapper nbguard installs: its _Site (found again, never stacked)
_FOLLOW = 16  # __wrapped__ links followed to find ours under someone else's wrapper


def _read(owner: Any, name: Any) -> Any:
    """What ``owner`` holds under ``name`` now (None: nothing)."""
    if isinstance(owner, list):
        return owner[name] if isinstance(name, int) and 0 <= name < len(owner) else None
    return getattr(owner, name, None)


def _write(owner: Any, name: Any, value: Any) -> None:
    if isinstance(owner, list):
        owner[name] = value
    else:
        setattr(owner, name, value)


class _Site:
    """One wrapper on one attribute of one owner, and the patches it runs (oldest innermost)."""

    def __init__(self, owner: Any, name: Any, slot: str):
        if isinstance(owner, list):
            if _read(owner, name) is None:
                raise IndexError(f"no item {name!r} in a list of {len(owner)}")
            self.original = owner[name]
        else:
            self.original = getattr(owner, name)  # AttributeError: nothing to wrap
        self.owner, self.name, self.slot = owner, name, slot
        self.patches: list[Patch] = []
        # what remove puts back: the owner's own object (a list's item, a module's function, an instance
        # attribute, a class's staticmethod as stored), or nothing where the instance reads it from its
        # class. No __dict__ (slots): the attribute is its own, put back by assignment.
        own = None if isinstance(owner, list) else getattr(owner, "__dict__", None)
        self.had_own = own is None or name in own
        self.own = self.original if own is None else own.get(name)
        site = self

        @functools.wraps(self.original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return site.call(args, kwargs)

        setattr(wrapper, slot, self.original)
        setattr(wrapper, MARK, self)
        self.wrapper = wrapper
        _write(owner, name, wrapper)

    @property
    def inner(self) -> Any:
        """What the wrapper calls under nbguard's parts: the original, or what a fix slipped in."""
        return getattr(self.wrapper, self.slot)

    def call(self, args: tuple, kwargs: dict) -> Any:
        call = self.inner
        for patch in tuple(self.patches):
            call = functools.partial(guarded_around, patch.on_error, patch.around, call)
        return call(*args, **kwargs)

    def uninstall(self) -> None:
        if _read(self.owner, self.name) is not self.wrapper:
            return  # wrapped or replaced since: ours stays where it is, calling straight through
        inner = self.inner
        if inner is not self.original:  # a fix slipped in under the patch: it stays
            _write(self.owner, self.name, inner)
        elif self.had_own:
            _write(self.owner, self.name, self.own)
        else:
            delattr(self.owner, self.name)


def find_patch(owner: Any, name: Any) -> _Site | None:
    """nbguard's wrapper on ``owner``'s ``name``: the attribute itself, or under wrappers set on it since."""
    value = _read(owner, name)
    for _ in range(_FOLLOW):
        if value is None:
            return None
        try:
            site = getattr(value, MARK, None)
            if isinstance(site, _Site) and site.owner is owner and site.name == name and site.wrapper is value:
                return site
            value = getattr(value, "__wrapped__", None)
        except Exception:  # an object whose attribute lookup raises is nobody's wrapper of ours
            return None
    return None


def is_patched(owner: Any, name: Any) -> bool:
    """Whether some nbguard patch on ``owner``'s ``name`` is in force."""
    site = find_patch(owner, name)
    return site is not None and bool(site.patches)


def unpatched(value: Any) -> Any:
    """``value`` without nbguard's wrapper: what the wrapper calls, or ``value`` itself."""
    site = getattr(value, MARK, None)
    return site.inner if isinstance(site, _Site) and site.wrapper is value else value


class Patch:
    """One around on ``owner``'s ``name`` (see the module's docstring); ``remove`` takes it off."""

    def __init__(self, owner: Any, name: Any, around: Callable[..., Any], on_error: OnError = warn_failure,
                 *, slot: str = "__wrapped__"):
        self.around, self.on_error = around, on_error
        site = find_patch(owner, name)
        self.site = site if site is not None else _Site(owner, name, slot)
        self.site.patches.append(self)

    @property
    def wrapper(self) -> Callable[..., Any]:
        return self.site.wrapper

    @property
    def inner(self) -> Any:
        return self.site.inner

    def remove(self) -> None:
        """Take this around off; the last one out puts the attribute back. Safe to call twice."""
        patches = self.site.patches
        if any(p is self for p in patches):
            patches[:] = [p for p in patches if p is not self]
            if not patches:
                self.site.uninstall()


def patch(owner: Any, name: Any, around: Callable[..., Any], on_error: OnError = warn_failure,
          *, slot: str = "__wrapped__") -> Patch:
    """``owner``'s ``name`` (an attribute, or a list's index) wrapped with ``around``; see the module."""
    return Patch(owner, name, around, on_error, slot=slot)


InstanceWrap = Patch  # the name its first callers (optimizer, GradScaler, Trainer taps) know it by
