"""The package's import graph: the document layer at the bottom, and no cycles anywhere.

Every ``import`` statement counts, function-local ones included: a cycle dodged by importing inside
a function is still a cycle.
"""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "nbguard"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_package(name: str) -> bool:
    return (PACKAGE.parent / name.replace(".", "/") / "__init__.py").exists()


def _resolve(module: str, level: int, target: str | None) -> str:
    base = module.split(".") if _is_package(module) else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join([*base, target] if target else base)


def import_graph() -> dict[str, set[str]]:
    """module -> the nbguard modules it imports (``from pkg import name`` counts ``pkg.name`` when
    that is a module, else ``pkg``)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py") if "labextension" not in p.parts}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
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
