"""Known warnings explained under the cell that raised them, once each per session.

Listens without taking anything away from the user:

* ``warnings``: ``warnings.showwarning`` is wrapped, and the wrapper calls the function it
  replaced. It only runs for warnings the filters decided to show, so nbguard explains exactly
  the warnings the user sees (a warning a library records with ``catch_warnings`` is not seen).
* ``logging``: one handler on each logger a signature names (``transformers``, ``bitsandbytes``).
  Where it is the only handler a record would reach, it hands the record to ``logging.lastResort``
  as Python would have without it, so adding it never silences a warning.

The diagnoses are shown at ``post_run_cell``, under the cell's own output. Unload puts
``showwarning`` back (or, when someone wrapped it after us, turns our wrapper into a pass-through)
and removes the handlers and the event callback.
"""
from __future__ import annotations

import logging
import sys
import warnings
from collections.abc import Callable
from typing import Any

from ..document.outward import say


class _Handler(logging.Handler):
    def __init__(self, on_record: Callable[[str, str], None]):
        super().__init__(level=logging.WARNING)
        self._on_record = on_record

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._on_record(record.getMessage(), record.name)
        except Exception:  # noticing a warning must never disturb the code that logged it
            pass
        last_resort = logging.lastResort
        if last_resort is not None and self._only_handler(record) and record.levelno >= last_resort.level:
            last_resort.handle(record)  # what logging would have done without us

    def _only_handler(self, record: logging.LogRecord) -> bool:
        """True when no other handler is on the record's way up (so Python would use lastResort)."""
        logger: logging.Logger | None = logging.getLogger(record.name)
        while logger is not None:
            if any(h is not self for h in logger.handlers):
                return False
            logger = logger.parent if logger.propagate else None
        return True


class WarningExplainer:
    """Collects the known warnings a cell shows and displays each one's diagnosis once."""

    def __init__(self, shell, show: Callable[[Any], None]):
        self.shell = shell
        self.show = show
        self.pending: list[tuple[str, str]] = []  # (text, origin) seen during the running cell
        self.shown: set[str] = set()  # signature ids already explained in this session
        self.installed = False
        self._previous_showwarning: Callable | None = None
        self._handler = _Handler(self._noticed)
        self._loggers: list[logging.Logger] = []

    def install(self) -> None:
        if self.installed:
            return
        from ..explainer.warnings import logger_names

        self._previous_showwarning = warnings.showwarning
        warnings.showwarning = self._showwarning
        self._loggers = [logging.getLogger(name) for name in logger_names()]
        for logger in self._loggers:
            logger.addHandler(self._handler)
        self.shell.events.register("post_run_cell", self._post_run_cell)
        self.installed = True

    def uninstall(self) -> None:
        if not self.installed:
            return
        if warnings.showwarning == self._showwarning and self._previous_showwarning is not None:
            warnings.showwarning = self._previous_showwarning  # (==: a bound method is a new object each time)
        # else: wrapped again after us; our wrapper stays in that chain as a pass-through
        for logger in self._loggers:
            logger.removeHandler(self._handler)
        self._loggers = []
        self.shell.events.unregister("post_run_cell", self._post_run_cell)
        self.installed = False
        self.pending.clear()

    # -- the channels ----------------------------------------------------------------------------
    def _showwarning(self, message, category, filename, lineno, file=None, line=None):
        if self.installed:
            try:
                self._noticed(str(message), getattr(category, "__name__", str(category)))
            except Exception:
                pass
        previous = self._previous_showwarning or warnings._showwarning_orig
        return previous(message, category, filename, lineno, file, line)

    def _noticed(self, text: str, origin: str) -> None:
        if self.installed and len(self.pending) < 100:  # a warning in a loop: the first ones suffice
            self.pending.append((text, origin))

    # -- under the cell --------------------------------------------------------------------------
    def _post_run_cell(self, result=None) -> None:
        pending, self.pending = self.pending, []
        for text, origin in pending:
            self.explain(text, origin)

    def explain(self, text: str, origin: str):
        """Show the diagnosis of one warning unless its signature was explained already."""
        try:
            from ..explainer import diagnose_warning
            from ..session import record_diagnosis

            diagnosis = diagnose_warning(text, origin)
            if diagnosis is None or diagnosis.signature in self.shown:
                return None
            self.shown.add(diagnosis.signature)
            record_diagnosis(diagnosis)
            self.show(diagnosis)
            return diagnosis
        except Exception as err:  # an explanation must never become a second problem
            say(f"nbguard: could not explain a warning ({type(err).__name__}: {err}); this is a bug in "
                "nbguard, please report it", file=sys.stderr)
            return None
