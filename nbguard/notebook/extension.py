"""``%load_ext nbguard`` / ``%unload_ext nbguard``: what the extension adds, and taking it all back.

Load registers the magics, their tab completers, the explainer of exceptions and of known warnings
(``post_run_cell`` callbacks: nbguard owns no exception handler), the warning listeners and the
comm to the lab extension. Unload removes exactly those, puts back any magics nbguard shadowed,
detaches watches started by ``%nanwatch``, closes the widgets it opened and the comm. Loading
twice is harmless.
"""
from __future__ import annotations

import sys
from typing import Any

from ..document.outward import say
from ..session import SESSION
from . import present
from . import resolve as R
from .cellwarnings import WarningExplainer
from .comm import CHANNEL
from .exceptions import ExplainerHandler

MAGIC_NAMES = {"line": ("precision_check", "nanwatch", "nbguard"), "cell": ("nanwatch",)}


class ExtensionState:
    def __init__(self, shell: Any) -> None:
        self.shell = shell
        self.watches: list[Any] = []  # LiveWatch objects started by %nanwatch
        self.last_names: dict[str, str] = {}  # the user's names from the last %precision_check
        self.last_audit = None
        self.shadowed: dict[str, dict[str, Any]] = {}  # magics of the same name that existed before
        self.magics: Any = None
        self.completers: Any = None
        self.handler = ExplainerHandler(shell, show=self.show_diagnosis)
        self.warnings = WarningExplainer(shell, show=self.show_diagnosis)

    # -- names and objects for fix code -------------------------------------------------------
    def names_for_fixes(self) -> dict[str, str]:
        """The user's variable names: from the last audit, else the one trainer/model in the namespace
        (plus the one TrainingArguments and tokenizer when there is no trainer to reach them through)."""
        names = dict(self.last_names)
        ns = self.shell.user_ns
        if not (("trainer" in names or "model" in names) and all(n.split(".")[0] in ns for n in names.values())):
            names = {}
            self._find_name(names, "trainer", R.is_trainer, "trainers")
            if "trainer" not in names:
                self._find_name(names, "model", R.is_model, "models", top_level=True)
        if "trainer" not in names:
            if "args" not in names:
                self._find_name(names, "args", R.is_training_args, "TrainingArguments")
            self._find_name(names, "tokenizer", R.is_tokenizer, "tokenizers")
        if "trainer" not in names and "args" not in names:  # a plain loop: the optimizer the last magic named
            for key in ("optimizer", "scaler"):
                if key not in names and SESSION.names.get(key, "").split(".")[0] in ns:
                    names[key] = SESSION.names[key]
        return names

    def _find_name(self, names: dict[str, str], key: str, predicate, what: str, top_level: bool = False) -> None:
        """``names[key]`` = the one variable passing ``predicate``; nothing when none or ambiguous."""
        found = R.candidates(self.shell.user_ns, predicate)
        if top_level:
            found = R.top_level_models(found)
        try:
            one = R.unique(found, what, "")
        except R.MagicError:
            return  # ambiguous: no name is guessed; fixes that need one get no cell
        if one:
            names[key] = one[0]

    def show_diagnosis(self, diagnosis) -> None:
        names = self.names_for_fixes()

        def apply(fix_id: str):
            from .. import fixes

            # looked up at click time: the view keeps names, never the user's objects
            targets = {k: R.lookup(self.shell.user_ns, v) for k, v in names.items()
                       if k in ("model", "trainer", "args", "tokenizer", "optimizer", "scaler")}
            if not targets:
                raise R.MagicError("no model, trainer or TrainingArguments variable found to apply the fix to")
            options = diagnosis.fix_options.get(fix_id, {})
            applied = fixes.apply(fix_id, **targets, names=names, **options)
            return applied.changed, applied.code

        present.show_diagnosis(diagnosis, names=names, apply=apply)

    # -- watches --------------------------------------------------------------------------------
    def stop_watch(self, live) -> None:
        if live in self.watches:
            self.watches.remove(live)
        try:
            watch = live.watch
            if watch is not None:
                watch.detach()
        finally:
            live.finish()

    def stop_watches(self) -> list[Any]:
        stopped = list(self.watches)
        for live in stopped:
            self.stop_watch(live)
        return stopped


_STATES: dict[int, ExtensionState] = {}


def load(ipython) -> ExtensionState:
    state = _STATES.get(id(ipython))
    if state is not None:
        return state  # loaded already: nothing stacks
    from .magics import NbguardMagics

    state = ExtensionState(ipython)
    manager = ipython.magics_manager
    for kind, names in MAGIC_NAMES.items():
        for name in names:
            if name in manager.magics[kind]:
                state.shadowed.setdefault(kind, {})[name] = manager.magics[kind][name]
    state.magics = NbguardMagics(ipython, state)
    ipython.register_magics(state.magics)
    state.handler.install()
    state.warnings.install()
    from .complete import Completers

    state.completers = Completers(ipython, state.magics)
    state.completers.install()
    try:
        CHANNEL.open(ipython)
    except Exception as err:  # no comm: "Insert cell" falls back to a code block
        say(f"nbguard: the lab extension channel could not open ({err}); continuing without it", file=sys.stderr)
    _STATES[id(ipython)] = state
    return state


def unload(ipython) -> None:
    state = _STATES.pop(id(ipython), None)
    if state is None:
        return
    state.stop_watches()
    state.handler.uninstall()
    state.warnings.uninstall()
    if state.completers is not None:
        state.completers.uninstall()
    manager = ipython.magics_manager
    for kind, names in MAGIC_NAMES.items():
        for name in names:
            previous = state.shadowed.get(kind, {}).get(name)
            if previous is not None:
                manager.magics[kind][name] = previous
            else:
                manager.magics[kind].pop(name, None)
    manager.registry.pop(type(state.magics).__name__, None)
    present.close_all()
    CHANNEL.close()


def state_of(ipython) -> ExtensionState | None:
    return _STATES.get(id(ipython))
