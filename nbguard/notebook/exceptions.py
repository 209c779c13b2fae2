"""The IPython custom exception handler that follows a known error's traceback with a diagnosis.

The normal traceback always shows first (IPython's own ``showtraceback``, so ``%debug``,
``sys.last_exc`` and the kernel's error reply behave as before). A handler that was installed
before nbguard keeps its exceptions: it runs instead of the plain traceback for them, and is put
back on unload.
"""
from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any


class ExplainerHandler:
    """Installs into one shell; ``uninstall()`` restores exactly what was there."""

    def __init__(self, shell, show: Callable[[Any], None]):
        self.shell = shell
        self.show = show  # shows a Diagnosis (the card with fix buttons, or the static bundle)
        self.previous: tuple[tuple, Any] | None = None
        self.last_diagnosis = None
        self.last_exception: BaseException | None = None

    @property
    def installed(self) -> bool:
        return self.previous is not None

    def install(self) -> None:
        if self.installed:
            return
        shell = self.shell
        self.previous = (tuple(shell.custom_exceptions), shell.CustomTB)
        handled = (Exception,) + tuple(e for e in self.previous[0] if not issubclass(e, Exception))
        shell.set_custom_exc(handled, self._handle)

    def uninstall(self) -> None:
        if not self.installed:
            return
        exceptions, custom_tb = self.previous
        self.shell.custom_exceptions = exceptions
        self.shell.CustomTB = custom_tb
        self.previous = None

    # -- the handler itself (called by IPython as handler(shell, etype, value, tb, tb_offset)) ------
    def _handle(self, shell, etype, value, tb, tb_offset=None):
        previous_types, previous_tb = self.previous or ((), None)
        if previous_types and isinstance(value, previous_types):
            stb = previous_tb(etype, value, tb, tb_offset=tb_offset)  # the earlier handler shows its own view
        else:
            shell.showtraceback((etype, value, tb), tb_offset=tb_offset)
            stb = None
        self.explain(value)
        return stb

    def explain(self, value: BaseException):
        """Diagnose ``value`` and show the card; errors here are reported, never raised."""
        self.last_exception = value
        try:
            from ..explainer import explain

            diagnosis = explain(value)
        except Exception as err:  # a bug in a rule must not hide the user's own error
            print(f"nbguard: the explainer failed ({type(err).__name__}: {err})", file=sys.stderr)
            return None
        if diagnosis is not None:
            self.last_diagnosis = diagnosis
            try:
                self.show(diagnosis)
            except Exception as err:
                print(f"nbguard: could not show the diagnosis ({type(err).__name__}: {err})", file=sys.stderr)
        return diagnosis
