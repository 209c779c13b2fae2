"""One way to put a wrapper on a user's object: an instance attribute that user code cannot tell
from the method it wraps.

accelerate's ``AcceleratedOptimizer.zero_grad`` reads ``inspect.signature(optimizer.zero_grad)`` and
refuses ``set_to_none`` when the parameter is missing, so a ``(*args, **kwargs)`` wrapper broke every
accelerate loop. ``functools.wraps`` copies the name, docstring and module and sets ``__wrapped__``,
which ``inspect.signature`` follows: readers see the original's signature, and every argument the
original takes reaches it unchanged.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

MARK = "__nbguard__"  # on every wrapper nbguard installs: found again, never stacked


class InstanceWrap:
    """``obj.<name>`` replaced by ``functools.wraps(original)(wrapper)``, where the wrapper calls
    ``around(original, *args, **kwargs)``; ``remove`` puts back what the instance had (a method the
    user set on it, or nothing, so the class's own shows through again)."""

    def __init__(self, obj: Any, name: str, around: Callable[..., Any]):
        self.obj, self.name = obj, name
        self._had_own = name in vars(obj)
        self._own = vars(obj).get(name)
        original = getattr(obj, name)

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return around(original, *args, **kwargs)

        setattr(wrapper, MARK, True)
        setattr(obj, name, wrapper)
        self.wrapper = wrapper

    def remove(self) -> None:
        if self._had_own:
            setattr(self.obj, self.name, self._own)
        else:
            vars(self.obj).pop(self.name, None)
