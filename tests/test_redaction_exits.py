"""Issue 40 item 3: one redaction boundary. This walks nbguard's source (AST), finds every place that writes
outward (``warnings.warn``, ``print``, ``display``/``publish_display_data``, a comm's ``send``, tracker writes,
file writes, ``__repr__``/``__str__``, public result dataclasses' generated repr) and fails on one whose text
does not pass ``nbguard.document.outward``.

What counts as passing: the text is a literal, or its expression calls a boundary function
(``outward``, ``outward_text``, ``exception_line``, ``dataclass_repr``) or a function whose every return does
(found to a fixed point over the whole package, e.g. ``event_text``), or it is a local name every
assignment of which does. The exits that write through the boundary's own ``warn``/``say`` are the boundary.
A few exits carry no text of their own, or text already redacted where it was made; each is listed in
``EXEMPT`` with the reason. A new exit that bypasses the boundary fails here, by file, line and kind."""
from __future__ import annotations

import ast
import dataclasses
import importlib
from pathlib import Path

import pytest

import nbguard
from nbguard.document import display, outward

ROOT = Path(nbguard.__file__).parent
BOUNDARY_FILE = "document/outward.py"
BOUNDARY = frozenset({"outward", "outward_text", "exception_line", "dataclass_repr"})
# the redaction algorithm and its own helpers: what the boundary calls, not an exit
SKIP_FILES = frozenset({BOUNDARY_FILE, "document/redact.py"})

# exit -> the arguments that carry text: positions, keyword names ("*" every positional)
EXITS: dict[str, tuple[tuple[int | str, ...], tuple[str, ...]]] = {
    "warnings.warn": ((0,), ("message",)),
    "print": (("*",), ()),
    "display": (("*",), ()),
    "publish_display_data": ((0,), ("data",)),
    "send": ((0,), ("data",)),
    "write_text": ((0,), ("data",)),
    "add_text": ((1,), ("text_string",)),
    "alert": ((0, 1), ("title", "text")),
    "set_tag": ((-1,), ("value",)),
}
TRACKER_ONLY = {"log": ((0,), ())}  # run.log({...}) in the trackers package (logging.log elsewhere is not an exit)

EXEMPT = {
    ("notebook/magics.py", "display"): "a Displayable result: its _repr_mimebundle_ redacts the document (outward)",
    ("watcher/distributed/stream.py", "send"): "a rank's events to rank 0 of the same job (no process boundary to the user); "
                                   "rank 0 shows them through the boundary",
    ("introspect/inert_pickle.py", "__repr__"): "a stand-in for a pickle's global, read by the audit into evidence; "
                                                "never shown but through a document",
}


def _sources() -> dict[str, ast.Module]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel not in SKIP_FILES:
            out[rel] = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    return out


def _call_name(call: ast.Call) -> str | None:
    f = call.func
    if isinstance(f, ast.Name):
        return f.id
    if isinstance(f, ast.Attribute):
        return f.attr
    return None


def _parents(tree: ast.AST) -> dict[ast.AST, ast.AST]:
    return {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def _enclosing(node: ast.AST, parents: dict) -> ast.AST | None:
    while node in parents:
        node = parents[node]
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return node
    return None


class Checker:
    def __init__(self, sources: dict[str, ast.Module]):
        self.sources = sources
        self.redacting: set[str] = set(BOUNDARY)
        functions: dict[str, list[ast.FunctionDef]] = {}
        for tree in sources.values():
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    functions.setdefault(node.name, []).append(node)
        changed = True
        while changed:  # a function is redacting when every definition of that name returns clean text
            changed = False
            for name, defs in functions.items():
                if name in self.redacting or name.startswith("__"):
                    continue
                if all(self._returns_clean(d) for d in defs):
                    self.redacting.add(name)
                    changed = True

    def _returns_clean(self, fn: ast.AST) -> bool:
        returns = [n for n in ast.walk(fn) if isinstance(n, ast.Return) and n.value is not None]
        return bool(returns) and all(self.clean(r.value, fn) for r in returns)

    def clean(self, expr: ast.AST, fn: ast.AST | None, depth: int = 0) -> bool:
        if isinstance(expr, ast.Constant):
            return True
        if isinstance(expr, ast.JoinedStr) and all(isinstance(v, ast.Constant) for v in expr.values):
            return True
        for node in ast.walk(expr):
            if isinstance(node, ast.Call) and _call_name(node) in self.redacting:
                return True
        if isinstance(expr, ast.Name) and fn is not None and depth < 3:
            values = [n.value for n in ast.walk(fn) if isinstance(n, (ast.Assign, ast.AnnAssign))
                      and n.value is not None
                      and any(isinstance(t, ast.Name) and t.id == expr.id
                              for t in (n.targets if isinstance(n, ast.Assign) else [n.target]))]
            return bool(values) and all(self.clean(v, fn, depth + 1) for v in values)
        return False

    def exits(self) -> list[tuple[str, int, str, str]]:
        """(file, line, kind, 'ok' / 'exempt' / 'BYPASS') for every exit in the package."""
        found = []
        for rel, tree in self.sources.items():
            parents = _parents(tree)
            warn_names = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                          and n.module == "warnings" for a in n.names if a.name == "warn"}
            for node in ast.walk(tree):
                kind = None
                if isinstance(node, ast.Attribute) and node.attr == "warn" and isinstance(node.value, ast.Name) \
                        and node.value.id == "warnings" and not (isinstance(parents.get(node), ast.Call)
                                                                 and parents[node].func is node):
                    found.append((rel, node.lineno, "warnings.warn (passed as a value)", "BYPASS"))
                    continue
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in ("__repr__", "__str__"):
                    ok = self._returns_clean(node)
                    found.append((rel, node.lineno, node.name, self._verdict(rel, node.name, ok)))
                    continue
                if not isinstance(node, ast.Call):
                    continue
                name = _call_name(node)
                if isinstance(node.func, ast.Attribute) and name == "warn" and isinstance(node.func.value, ast.Name) \
                        and node.func.value.id == "warnings":
                    kind = "warnings.warn"
                elif isinstance(node.func, ast.Name) and name in warn_names:
                    kind = "warnings.warn"
                elif name in EXITS and name != "warnings.warn":
                    kind = name
                elif rel.startswith("trackers/") and name in TRACKER_ONLY and isinstance(node.func, ast.Attribute):
                    kind = name
                if kind is None:
                    continue
                if kind == "print" and isinstance(node.func, ast.Attribute):
                    continue  # a method named print (not the builtin)
                if kind == "display" and not isinstance(node.func, ast.Name):
                    continue
                spec = EXITS.get(kind) or TRACKER_ONLY[kind]
                texts = self._texts(node, spec)
                fn = _enclosing(node, parents)
                ok = all(self._text_clean(t, fn, numbers=kind == "log") for t in texts)
                found.append((rel, node.lineno, kind, self._verdict(rel, kind, ok)))
        return found

    def _text_clean(self, expr: ast.AST, fn, numbers: bool = False) -> bool:
        """``numbers``: a tracker's log, whose dicts hold numbers by name (a step, the scalars) and text."""
        if numbers and isinstance(expr, ast.Dict):
            return all(self._text_clean(v, fn, numbers) for v in expr.values
                       if not isinstance(v, ast.Name) and not (isinstance(v, ast.Attribute) and v.attr == "step"))
        if numbers and isinstance(expr, ast.Name) and fn is not None:  # a parameter typed as numbers only
            for arg in fn.args.args + fn.args.kwonlyargs:
                if arg.arg == expr.id and arg.annotation is not None:
                    return ast.unparse(arg.annotation) in ("dict[str, float]", "float", "int")
        return self.clean(expr, fn)

    @staticmethod
    def _texts(call: ast.Call, spec) -> list[ast.AST]:
        positions, keywords = spec
        args = [a for a in call.args if not isinstance(a, ast.Starred)]
        out = []
        for p in positions:
            if p == "*":
                out += args
            elif isinstance(p, int) and -len(args) <= p < len(args):
                out.append(args[p])
        out += [k.value for k in call.keywords if k.arg in keywords]
        return out

    @staticmethod
    def _verdict(rel: str, kind: str, ok: bool) -> str:
        if ok:
            return "ok"
        return "exempt" if (rel, kind) in EXEMPT else "BYPASS"


@pytest.fixture(scope="module")
def checker():
    return Checker(_sources())


def test_every_exit_passes_the_boundary(checker):
    found = checker.exits()
    bypasses = [f"nbguard/{rel}:{line}: {kind}" for rel, line, kind, verdict in found if verdict == "BYPASS"]
    assert not bypasses, "exits that bypass nbguard.document.outward:\n" + "\n".join(bypasses)
    kinds = {kind for _, _, kind, verdict in found if verdict == "ok"}
    # the walk sees every kind of exit the package has (a walker that finds nothing would pass anything)
    assert {"__repr__", "__str__", "add_text", "alert", "set_tag", "log", "send", "write_text"} <= kinds, kinds
    assert len(found) >= 25


def test_every_exemption_is_still_needed(checker):
    used = {(rel, kind) for rel, _, kind, verdict in checker.exits() if verdict == "exempt"}
    assert set(EXEMPT) == used, f"exemptions no exit needs any more: {set(EXEMPT) - used}"


def test_the_boundary_helpers_are_the_only_direct_warn_and_print():
    """``outward.warn`` and ``outward.say`` are the package's warnings.warn and print: nowhere else is
    either called (the checker above would accept a literal; the boundary's helpers are simpler to audit)."""
    direct = []
    for rel, tree in _sources().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and (
                    (isinstance(node.func, ast.Name) and node.func.id == "print")
                    or (isinstance(node.func, ast.Attribute) and node.func.attr == "warn"
                        and isinstance(node.func.value, ast.Name) and node.func.value.id == "warnings")):
                direct.append(f"nbguard/{rel}:{node.lineno}")
    assert direct == [], direct


@pytest.mark.parametrize("source, kind", [
    ("import warnings\ndef f(exc):\n    warnings.warn(f'failed: {exc}')\n", "warnings.warn"),
    ("from warnings import warn\ndef f(exc):\n    warn(str(exc))\n", "warnings.warn"),
    ("def f(exc):\n    print('nbguard:', exc)\n", "print"),
    ("def f(writer, event):\n    writer.add_text('nbguard/events', event.message, 1)\n", "add_text"),
    ("def f(run, event):\n    run.alert(title='nbguard', text=event.message)\n", "alert"),
    ("def f(comm, code):\n    comm.send({'code': code})\n", "send"),
    ("class R:\n    def __repr__(self):\n        return f'R({self.secret})'\n", "__repr__"),
    ("def f(path, text):\n    path.write_text(text)\n", "write_text"),
])
def test_the_walk_fails_on_a_new_exit_that_bypasses_the_boundary(checker, source, kind):
    probe = Checker({"probe.py": ast.parse(source)})
    probe.redacting |= checker.redacting
    assert [(k, v) for _, _, k, v in probe.exits()] == [(kind, "BYPASS")]
    fixed = source.replace("event.message", "outward_text(event.message)").replace("{self.secret}", "")
    if fixed != source:
        assert [v for _, _, _, v in Checker({"probe.py": ast.parse(fixed)}).exits()] == ["ok"]


def _public_result_classes() -> list[type]:
    """Every Displayable (the results users hold and print) and the parts they hand out."""
    for rel in sorted(p.relative_to(ROOT).with_suffix("").as_posix() for p in ROOT.rglob("*.py")):
        if "labextension" in rel or rel.endswith("__main__"):
            continue
        try:
            importlib.import_module("nbguard." + rel.replace("/", ".").removesuffix(".__init__"))
        except ImportError:  # an optional dependency (deepspeed, ...) this machine does not have
            continue
    seen, todo = [], list(display.Displayable.__subclasses__())
    while todo:
        cls = todo.pop()
        if cls not in seen:
            seen.append(cls)
            todo += cls.__subclasses__()
    from nbguard.document import model
    from nbguard.verifier import result

    return seen + [model.Finding, model.Event, model.Origin, result.StepEvidence, result.ModuleEvidence,
                   result.ModuleCheck, result.FixVerdict]


def test_public_result_classes_repr_through_the_boundary():
    """A ``@dataclass`` generates a ``__repr__`` of every field (``repr([nbguard.explain(exc)])`` showed the
    exception's token): each public result class declares ``repr=False`` or its own checked repr."""
    classes = _public_result_classes()
    assert len(classes) >= 10
    generated = []
    for cls in classes:
        repr_fn = cls.__repr__
        if repr_fn in (display.Displayable.__repr__, outward.dataclass_repr):
            continue
        if dataclasses.is_dataclass(cls) and cls.__dataclass_params__.repr \
                and repr_fn.__qualname__ == f"{cls.__qualname__}.__repr__" \
                and getattr(repr_fn, "__wrapped__", None) is not None:
            generated.append(cls.__qualname__)  # dataclasses' own repr (reprlib.recursive_repr wraps it)
            continue
        assert repr_fn.__module__.startswith("nbguard."), (cls, repr_fn)  # one the source walk above checked
    assert generated == []
