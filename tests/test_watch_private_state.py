"""Nothing outside the watch core touches the watch's private state: a component uses its WatchContext.

The core is the watch class in its layers (watcher/core/: record, steps, lifecycle, watch) and the context;
every other module of nbguard that reaches ``watch._something`` (or ``getattr(watch, "_something")``)
couples itself to the core's internals, which is what the component protocol exists to prevent.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "nbguard"
CORE = {f"watcher/core/{name}.py" for name in ("record", "steps", "lifecycle", "watch", "context")}
# an expression that names a watch: `watch`, `self.watch`, `live_watch`, `self._watch` (a context's own)
WATCH_NAME = re.compile(r"(^|_)watch$")


def _names_a_watch(node: ast.expr) -> bool:
    if isinstance(node, ast.Name):
        return bool(WATCH_NAME.search(node.id))
    if isinstance(node, ast.Attribute):
        return bool(WATCH_NAME.search(node.attr))
    if isinstance(node, ast.Call):  # weakref: `self.watch()._x`
        return _names_a_watch(node.func)
    return False


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_accesses(source: str) -> list[tuple[int, str]]:
    """(line, text) for each private attribute reached on an expression that names a watch."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and _private(node.attr) and _names_a_watch(node.value):
            found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "setattr") \
                and len(node.args) >= 2 and _names_a_watch(node.args[0]) \
                and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str) \
                and _private(node.args[1].value):
            found.append((node.lineno, ast.unparse(node)))
    return found


@pytest.mark.parametrize("planted", [
    "watch._ranks.rank", "self.watch._emit(event)", "watch._board.rewound(3)", "live_watch._stop(e)",
    "self.watch()._collector", "getattr(watch, '_bad_streak', 0)", "setattr(self.watch, '_broken', True)",
    "watch._micro_batches = []",
])
def test_the_walk_finds_each_form_of_private_access(planted):
    assert private_accesses(f"def f(self, watch, live_watch, e, event):\n    {planted}\n"), planted


@pytest.mark.parametrize("allowed", [
    "watch.emit(event)", "watch.step", "self.watch.__class__", "self._collector._on_error(exc)",
    "live._norms[0]", "watch.ranks",
])
def test_the_walk_leaves_public_access_and_other_objects_alone(allowed):
    assert private_accesses(f"def f(self, watch, live, event, exc):\n    {allowed}\n") == []


def test_no_module_outside_the_core_reaches_the_watchs_private_state():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative in CORE:
            continue
        offenders += [f"{relative}:{line}: {text}" for line, text in private_accesses(path.read_text())]
    assert offenders == [], ("use the component's WatchContext (nbguard/watcher/core/context.py) instead of the "
                             "watch's private state:\n" + "\n".join(offenders))


def _imported_modules(source: str, package: str) -> list[tuple[int, str]]:
    """(line, absolute module) for each import in a module of ``package`` (relative imports resolved)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[:len(base) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            found += [(node.lineno, module)] + [(node.lineno, f"{module}.{a.name}") for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
    return found


def test_the_core_names_no_component_it_reaches_them_through_the_registry():
    """Adding a component is adding its module to nbguard/watcher/components/: nothing else imports one (the
    registry imports the package, whose modules register themselves)."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        if relative.parts[:2] == ("watcher", "components"):
            continue
        package = ".".join(["nbguard", *relative.parent.parts])
        offenders += [f"{relative.as_posix()}:{line}: {module}" for line, module in _imported_modules(
            path.read_text(), package) if module.startswith("nbguard.watcher.components.")]
    assert offenders == [], "import a component through nbguard.watcher.core.registry, not directly:\n" + "\n".join(offenders)


def test_a_component_added_to_the_package_is_made_for_every_new_watch(tmp_path, monkeypatch):
    """The registry's whole promise: a module in components/ that registers itself is attached, called and
    detached by a watch that never names it."""
    import importlib
    import sys

    import torch

    import nbguard
    import nbguard.watcher.components as components
    from nbguard.watcher.core import registry

    module = tmp_path / "forward_counter.py"
    module.write_text(
        "from dataclasses import dataclass\n"
        "from nbguard.watcher.core.pipeline import WatchComponent\n"
        "from nbguard.watcher.core.registry import register_component\n"
        "SEEN = []\n"
        "@dataclass(frozen=True)\n"
        "class CounterSettings:\n"
        "    label: str = 'default'\n"
        "class ForwardCounter(WatchComponent):\n"
        "    def __init__(self, label):\n"
        "        self.label = label\n"
        "    def attach(self, context):\n"
        "        SEEN.append(('attach', self.label, context.step))\n"
        "    def on_forward_start(self):\n"
        "        SEEN.append(('forward', self.label))\n"
        "    def after_optimizer_step(self, step):\n"
        "        SEEN.append(('stepped', step))\n"
        "    def detach(self):\n"
        "        SEEN.append(('detach', self.label))\n"
        "register_component('forward_counter', lambda setup: ForwardCounter(setup.settings.label),\n"
        "                   settings=CounterSettings)\n")
    monkeypatch.setattr(components, "__path__", [*components.__path__, str(tmp_path)])
    try:  # (the package imports each of its modules at its own import: here, the one added since)
        counter = importlib.import_module("nbguard.watcher.components.forward_counter")
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        watch = nbguard.watch(model, optimizer=opt, verify=False, log_to=None,
                              config=nbguard.WatchConfig(forward_counter={"label": "mine"}))
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        watch.detach()
        assert counter.SEEN == [("attach", "mine", 0), ("forward", "mine"), ("stepped", 0), ("detach", "mine")]
    finally:
        registry._COMPONENTS.pop("forward_counter", None)
        sys.modules.pop("nbguard.watcher.components.forward_counter", None)
