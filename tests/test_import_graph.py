"""The package's import graph: the layers of docs/architecture.md in their order, and no cycles.

Every ``import`` statement counts, function-local ones included: a cycle dodged by importing inside
a function is still a cycle, and an upward import inside a function still goes up.
"""
from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "nbguard"
ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_package(name: str) -> bool:
    return (PACKAGE.parent / name.replace(".", "/") / "__init__.py").exists()


def _resolve(module: str, level: int, target: str | None) -> str:
    base = module.split(".") if _is_package(module) else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join([*base, target] if target else base)


@functools.cache
def _parsed() -> dict[str, tuple[Path, ast.Module]]:
    """module -> (its file, its syntax tree): every file parsed once for all the checks of this file."""
    return {_module_name(p): (p, ast.parse(p.read_text(encoding="utf-8"))) for p in PACKAGE.rglob("*.py")}


def import_graph() -> dict[str, set[str]]:
    """module -> the nbguard modules it imports (``from pkg import name`` counts ``pkg.name`` when
    that is a module, else ``pkg``). A fresh copy each call: a check may not change another's graph."""
    return {name: set(targets) for name, targets in _import_graph().items()}


@functools.cache
def _import_graph() -> dict[str, set[str]]:
    modules = {name: tree for name, (path, tree) in _parsed().items() if "labextension" not in path.parts}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, tree in modules.items():
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, node.level, node.module) if node.level else (node.module or "")
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def _unit(module: str) -> str:
    """The top-level part a module belongs to: ``nbguard.auditor.rules.cache`` -> ``nbguard.auditor``."""
    return ".".join(module.split(".")[:2])


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_module_imports_another_in_a_cycle():
    assert find_cycle(import_graph()) is None


def test_no_cycle_between_the_parts_of_the_package():
    units: dict[str, set[str]] = {}
    for module, targets in import_graph().items():
        units.setdefault(_unit(module), set()).update(_unit(t) for t in targets if _unit(t) != _unit(module))
    assert find_cycle(units) is None


def test_the_document_layer_imports_nothing_else_from_nbguard():
    outside = {t for m, ts in import_graph().items() if m.startswith("nbguard.document") for t in ts
               if not t.startswith("nbguard.document")}
    assert outside == set()


def test_nothing_imports_the_package_root():
    # the root is the public facade: a module importing it (for __version__, say) closes a cycle
    assert {m for m, ts in import_graph().items() if "nbguard" in ts} == set()


def test_the_cycle_finder_finds_a_planted_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


# ---- the layers, as docs/architecture.md documents them --------------------------------------
def documented_layers(text: str | None = None) -> dict[str, int]:
    """``nbguard.<part>`` -> its layer number, from the table rows ``| 1 | `document/` | ... |``."""
    text = ARCHITECTURE.read_text(encoding="utf-8") if text is None else text
    layers: dict[str, int] = {}
    for number, cell in re.findall(r"^\|\s*(\d+)\s*\|([^|]*)\|", text, flags=re.MULTILINE):
        for part in re.findall(r"`([^`]+)`", cell):
            name = "nbguard" if part == "__init__.py" else "nbguard." + part.removesuffix("/").removesuffix(".py")
            assert name not in layers, f"{part} is placed twice in docs/architecture.md"
            layers[name] = int(number)
    return layers


def upward_imports(graph: dict[str, set[str]], layers: dict[str, int]) -> list[str]:
    """Every import that goes to a higher layer than the importing module's."""
    return sorted(f"{m} (layer {layers[_unit(m)]}) imports {t} (layer {layers[_unit(t)]})"
                  for m, targets in graph.items() for t in targets if layers[_unit(t)] > layers[_unit(m)])


def test_every_module_is_placed_in_a_documented_layer():
    layers = documented_layers()
    assert len(set(layers.values())) >= 8  # the table was read, not an empty match
    assert sorted({_unit(m) for m in import_graph()} - set(layers)) == []
    assert sorted(set(layers) - {_unit(m) for m in import_graph()}) == []  # nothing documented that is gone


def test_no_module_imports_a_higher_layer():
    assert upward_imports(import_graph(), documented_layers()) == []


def test_the_layer_check_finds_a_planted_upward_import():
    layers = documented_layers("| 1 | `document/` | x |\n| 2 | `render/`, `api.py` | y |\n")
    assert layers == {"nbguard.document": 1, "nbguard.render": 2, "nbguard.api": 2}
    graph = {"nbguard.document.view": {"nbguard.render.text"}, "nbguard.api": {"nbguard.document"}}
    assert upward_imports(graph, layers) == [
        "nbguard.document.view (layer 1) imports nbguard.render.text (layer 2)"]


# ---- private names stay in their package ---------------------------------------------------------
def _package(module: str) -> str:
    """The package a module's private names belong to: ``nbguard.fixes.registry`` -> ``nbguard.fixes``."""
    return module if _is_package(module) else module.rsplit(".", 1)[0]


def private_reads(tree: ast.Module, module: str, modules: set[str]) -> list[str]:
    """``from <other package> import _name`` and ``<alias of another package's module>._name``."""
    found: list[str] = []
    aliases: dict[str, str] = {}
    own = _unit(module)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = _resolve(module, node.level, node.module) if node.level else (node.module or "")
            for alias in node.names:
                full = f"{base}.{alias.name}"
                if full in modules:
                    aliases[alias.asname or alias.name] = full
                elif base in modules and _unit(base) != own and _private(alias.name):
                    found.append(f"{module}: from {base} import {alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules and alias.asname:
                    aliases[alias.asname] = alias.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and _private(node.attr):
            target = aliases.get(node.value.id)
            if target is not None and _unit(target) != own:
                found.append(f"{module}: {node.value.id}._{node.attr.lstrip('_')} ({target})")
    return found


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_no_module_reads_another_packages_private_names():
    # A package's private names are its own: another package goes through a public function
    # (the shadow step finds the watches to quiet with ``nbguard.watcher.core.lifecycle.attached_watches``).
    modules = _parsed()
    found = [hit for name, (_, tree) in sorted(modules.items()) for hit in private_reads(tree, name, set(modules))]
    assert found == []


def test_the_private_name_check_finds_planted_reads():
    modules = {"nbguard.fixes", "nbguard.fixes.model_fixes", "nbguard.verifier", "nbguard.verifier.engine"}
    source = "from ..fixes.model_fixes import _configs, configs\nfrom ..fixes import model_fixes as mf\nmf._x\n"
    assert private_reads(ast.parse(source), "nbguard.verifier.engine", modules) == [
        "nbguard.verifier.engine: from nbguard.fixes.model_fixes import _configs",
        "nbguard.verifier.engine: mf._x (nbguard.fixes.model_fixes)"]
    assert private_reads(ast.parse("from .model_fixes import _configs\n"), "nbguard.fixes", modules) == []
