"""The explainer in the shell: a diagnosis card under a known error's traceback, through IPython's events.

nbguard does not own exceptions: IPython shows its own traceback (``%xmode`` applies, other
extensions' custom exception handlers keep theirs, ``%debug`` and ``sys.last_value`` behave as
before), and afterwards the ``post_run_cell`` event hands us the cell's ``result.error_in_exec``
(the same event and field in IPython 7.34, as in Colab, and in IPython 8/9). Unload unregisters
exactly the one callback load registered.
"""
from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from ..document.outward import say


class ExplainerHandler:
    """Listens to one shell's ``post_run_cell``; ``uninstall()`` removes only what ``install()`` added."""

    def __init__(self, shell, show: Callable[[Any], None]):
        self.shell = shell
        self.show = show  # shows a Diagnosis (the card with fix buttons, or the static bundle)
        self.installed = False
        self.last_diagnosis: Any = None
        self._shown: BaseException | None = None  # an error already explained under an inner cell

    def install(self) -> None:
        if not self.installed:
            self.shell.events.register("post_run_cell", self._post_run_cell)
            self.installed = True

    def uninstall(self) -> None:
        if self.installed:
            self.shell.events.unregister("post_run_cell", self._post_run_cell)
            self.installed = False

    def already_shown(self, error: BaseException) -> None:
        """``error`` was explained under an inner cell (``%%nanwatch``); the outer cell re-reports it."""
        self._shown = error

    def _post_run_cell(self, result) -> None:
        error = getattr(result, "error_in_exec", None)
        shown, self._shown = self._shown, None  # held only until the next cell ends
        if error is None or error is shown or _is_usage_error(error):
            return
        self.explain(error)

    def explain(self, value: BaseException):
        """Diagnose ``value`` and show the card; errors here are reported, never raised."""
        try:
            from ..explainer import explain

            diagnosis = explain(value)
        except Exception as err:  # a bug in a rule must not hide the user's own error
            say(f"nbguard: the explainer failed ({type(err).__name__}: {err}); this is a bug in nbguard, "
                "please report it", file=sys.stderr)
            return None
        if diagnosis is not None:
            self.last_diagnosis = diagnosis
            try:
                self.show(diagnosis)
            except Exception as err:
                say(f"nbguard: could not show the diagnosis ({type(err).__name__}: {err})", file=sys.stderr)
        return diagnosis


def _is_usage_error(error: BaseException) -> bool:
    from IPython.core.error import UsageError

    return isinstance(error, UsageError)
