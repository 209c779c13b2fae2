"""The one guarded call every watch hook goes through.

A hook runs inside the user's forward, backward, optimizer step or Trainer callback: an exception
escaping it would break their training run. ``guarded_call`` catches it and hands it to the
watch's error handler (which records a watch-error event and steps aside). Only ``NonFiniteError``
passes through: it is the stop policy ending a plain loop on purpose.

``guarded_around`` is the same guard for nbguard's part around one of the user's own calls (the
wrappers of ``integrations/instance_wrap.py``): there the user's call must still run exactly once and
its result, or its exception, reach the caller unchanged.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from ...document.outward import warn
from ...errors import NonFiniteError

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


def warn_failure(exc: BaseException) -> None:
    """The report of a failure with no watch to record it (a process-wide patch): a RuntimeWarning."""
    warn(f"nbguard's wrapper failed and stepped aside; your call ran unchanged: {exc!r}", RuntimeWarning,
         stacklevel=2)


class UserCall:
    """The user's call as an ``around`` receives it: ``call(*args, **kwargs)`` runs it, and
    ``call.instead(fn, *args, **kwargs)`` runs ``fn`` in its place (a clip with norms nbguard already
    computed). Either way its outcome is the user's: returned as is, its exception raised as is."""

    __slots__ = ("fn", "ran", "result", "error")

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn
        self.ran = False
        self.result: Any = None
        self.error: BaseException | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.instead(self.fn, *args, **kwargs)

    def instead(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        self.ran = True
        try:
            self.result = fn(*args, **kwargs)
        except BaseException as exc:
            self.error = exc
            raise
        self.error = None
        return self.result


def guarded_around(on_error: OnError, around: Callable[..., T], fn: Callable[..., Any], /,
                   *args: Any, **kwargs: Any) -> Any:
    """``around(call, *args, **kwargs)``, where ``call`` runs ``fn`` (the user's call): nbguard's part
    around it. An exception of nbguard's own becomes ``on_error(exc)`` and the user's call still
    counts: run now if the around failed before it, else what it returned is returned (what it
    raised, raised). The user's own exception, and ``NonFiniteError``, pass through unchanged."""
    call = UserCall(fn)
    try:
        return around(call, *args, **kwargs)
    except NonFiniteError:
        raise
    except Exception as exc:  # never break the user's run
        if call.error is exc:
            raise  # the user's own, passed on by the around
        _report(on_error, exc)
    if not call.ran:
        return fn(*args, **kwargs)
    if call.error is not None:
        raise call.error  # the user's call raised, then nbguard's part failed on top of it
    return call.result


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
