"""Tab completion for the magics' arguments: the notebook's own objects of the right kind.

Registered through IPython's ``complete_command`` hook (a string dispatch on the magic's name),
which IPython 7.34 and 8/9 both call; :class:`Completers` takes back exactly what it added.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import resolve as R
from .magics import NBGUARD_COMMANDS, POLICIES

HOOK = "complete_command"


def _names(ns: dict[str, Any], *predicates: Callable[[Any], bool]) -> list[str]:
    found = R.candidates(ns, lambda obj: any(p(obj) for p in predicates))
    return sorted(found)


def _options(parser_func: Callable) -> list[str]:
    parser = getattr(parser_func, "parser")  # noqa: B009  (set by @magic_arguments)
    return sorted(opt for action in parser._actions for opt in action.option_strings if opt.startswith("--"))


def _previous_word(event) -> str:
    """The word before the one being completed (``--optimizer`` in ``%nanwatch m --optimizer o<TAB>``)."""
    before = event.text_until_cursor if hasattr(event, "text_until_cursor") else event.line
    words = before.split()
    if before.endswith(" "):
        return words[-1] if words else ""
    return words[-2] if len(words) > 1 else ""


class Completers:
    def __init__(self, shell: Any, magics: Any) -> None:
        self.shell = shell
        self.magics = magics
        self._added: list[tuple[str, Callable]] = []
        self._created_dispatcher = False

    @property
    def ns(self) -> dict[str, Any]:
        return self.shell.user_ns

    def install(self) -> None:
        if self._added:
            return
        self._created_dispatcher = HOOK not in self.shell.strdispatchers
        for key, method in (("%precision_check", self.precision_check), ("%nanwatch", self.nanwatch),
                            ("%%nanwatch", self.nanwatch), ("%nbguard", self.nbguard)):
            def hook(_shell, event, method=method):  # set_hook binds hooks to the shell: (shell, event)
                return method(event)

            self.shell.set_hook(HOOK, hook, str_key=key)
            self._added.append((key, hook))

    def uninstall(self) -> None:
        dispatcher = self.shell.strdispatchers.get(HOOK)
        for key, func in self._added:
            chain = dispatcher.strs.get(key) if dispatcher is not None else None
            if chain is None:
                continue
            chain.chain = [(priority, f) for priority, f in chain.chain if getattr(f, "__func__", f) is not func]
            if not chain.chain:
                del dispatcher.strs[key]
        if self._created_dispatcher and dispatcher is not None and not dispatcher.strs and not dispatcher.regexs:
            del self.shell.strdispatchers[HOOK]
        self._added = []

    # -- the completers (event: .line, .symbol, .text_until_cursor) -------------------------------
    def precision_check(self, event) -> list[str]:
        previous = _previous_word(event)
        if previous == "--hardware":
            from ..hardware import PROFILES

            return sorted(PROFILES)
        if previous == "--batch":
            return _names(self.ns, R.is_batch)
        if event.symbol.startswith("-"):
            return _options(self.magics.precision_check)
        return _names(self.ns, R.is_trainer, R.is_model, R.is_training_args)

    def nanwatch(self, event) -> list[str]:
        previous = _previous_word(event)
        if previous == "--policy":
            return list(POLICIES)
        if previous == "--optimizer":
            return _names(self.ns, R.is_optimizer)
        if previous == "--scaler":
            return _names(self.ns, R.is_scaler)
        if event.symbol.startswith("-"):
            return _options(self.magics.nanwatch)
        return _names(self.ns, R.is_trainer, R.is_model) + ["off"]

    def nbguard(self, event) -> list[str]:
        before = event.text_until_cursor if hasattr(event, "text_until_cursor") else event.line
        words = before.split()
        completing_new = before.endswith(" ") or len(words) < 2
        position = len(words) if completing_new else len(words) - 1  # index of the word being completed
        if position <= 1:
            return list(NBGUARD_COMMANDS)
        if words[1] == "fix" and position == 2:
            from .. import fixes

            return fixes.available()
        if words[1] == "fix":
            return [flag for flag in ("--apply", "--force") if flag not in words[2:]]
        return []
