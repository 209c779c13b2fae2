"""The one guarded call every watch hook goes through.

A hook runs inside the user's forward, backward, optimizer step or Trainer callback: an exception
escaping it would break their training run. ``guarded_call`` catches it and hands it to the
watch's error handler (which records a watch-error event and steps aside). Only ``NonFiniteError``
passes through: it is the stop policy ending a plain loop on purpose.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from ..errors import NonFiniteError

T = TypeVar("T")
OnError = Callable[[BaseException], None]


def guarded_call(on_error: OnError, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T | None:
    """``fn(*args, **kwargs)``; an exception becomes ``on_error(exc)`` and the call returns None."""
    try:
        return fn(*args, **kwargs)
    except NonFiniteError:
        raise
    except Exception as exc:  # never break the user's run
        _report(on_error, exc)
        return None


def _report(on_error: OnError, exc: BaseException) -> None:
    try:
        on_error(exc)
    except Exception:  # the error path itself failed (e.g. warnings as errors): still not the user's
        pass


def guarded(fn: Callable[..., T], on_error: OnError) -> Callable[..., T | None]:
    """``fn`` wrapped in :func:`guarded_call`, for hooks handed to torch (tensor, module, optimizer)."""

    @functools.wraps(fn)
    def hook(*args: Any, **kwargs: Any) -> T | None:
        return guarded_call(on_error, fn, *args, **kwargs)

    return hook


def watch_hook(*, safe: bool) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate a ``NanWatch`` hook method: it runs only while the watch is active, guarded.

    ``safe`` says whether the watch may detach right away on an error (False inside torch's own
    iteration over hook dicts, where removing a hook would change the dict being iterated).
    """

    def decorate(method: Callable[..., Any]) -> Callable[..., Any]:
        # guarded_call's body inline: this runs several times per training step, and a closure and one
        # more call per hook cost more than the rest of a small hook
        @functools.wraps(method)
        def hook(self: Any, *args: Any, **kwargs: Any) -> Any:
            if not self.active:
                return None
            try:
                return method(self, *args, **kwargs)
            except NonFiniteError:
                raise
            except Exception as exc:  # never break the user's run
                _report(functools.partial(self._fail, safe=safe), exc)
                return None

        return hook

    return decorate
