"""nbguard never deserialises untrusted data with code in it: every torch.load says weights_only=True, and
nothing calls pickle's loaders, dill, joblib, cloudpickle, shelve, marshal or numpy's allow_pickle. The one
pickle reader (introspect/inert_pickle.py) overrides find_class and never reaches the real one. Walks the
source's syntax trees, so a new call site fails here before it ships."""
from __future__ import annotations

import ast
import pathlib

import nbguard

PACKAGE = pathlib.Path(nbguard.__file__).parent
# modules whose every loader runs code from the data
CODE_RUNNING_MODULES = {"dill", "joblib", "cloudpickle", "shelve", "marshal", "_pickle"}
PICKLE_LOADERS = {"load", "loads", "Unpickler"}


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def _keyword_is(call: ast.Call, name: str, value: object) -> bool:
    return any(k.arg == name and isinstance(k.value, ast.Constant) and k.value.value == value for k in call.keywords)


def unsafe_loads(source: str, filename: str) -> list[str]:
    """Every place in ``source`` that could deserialise code-bearing data, as 'file:line: why'."""
    tree = ast.parse(source, filename)
    found = []
    aliases: dict[str, str] = {}  # local name -> dotted origin, for `from torch import load` and `import pickle as p`
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                aliases[alias.asname or alias.name] = alias.name
                if alias.name.split(".")[0] in CODE_RUNNING_MODULES:
                    found.append(f"{filename}:{node.lineno}: imports {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                if node.module.split(".")[0] in CODE_RUNNING_MODULES:
                    found.append(f"{filename}:{node.lineno}: imports from {node.module}")
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            bases = {aliases.get(_dotted(b).split(".")[0], _dotted(b).split(".")[0]) + _dotted(b)[len(
                _dotted(b).split(".")[0]):] for b in node.bases}
            if "pickle.Unpickler" in bases:
                methods = {n.name: n for n in node.body if isinstance(n, ast.FunctionDef)}
                if "find_class" not in methods:
                    found.append(f"{filename}:{node.lineno}: Unpickler subclass without its own find_class")
                elif any(isinstance(c, ast.Call) and _dotted(c.func).endswith("find_class")
                         for c in ast.walk(methods["find_class"])):
                    found.append(f"{filename}:{node.lineno}: find_class reaches the real one")
            continue
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        head, _, rest = name.partition(".")
        full = aliases.get(head, head) + (f".{rest}" if rest else "")
        if full in ("torch.load", "torch.serialization.load") and not _keyword_is(node, "weights_only", True):
            found.append(f"{filename}:{node.lineno}: {full} without weights_only=True")
        elif full.startswith("pickle.") and full.split(".")[-1] in PICKLE_LOADERS:
            found.append(f"{filename}:{node.lineno}: {full}")
        elif full in ("numpy.load", "np.load") and not _keyword_is(node, "allow_pickle", False):
            found.append(f"{filename}:{node.lineno}: numpy.load without allow_pickle=False")
        elif full in ("pandas.read_pickle", "pd.read_pickle"):
            found.append(f"{filename}:{node.lineno}: {full}")
    return found


def test_no_module_of_nbguard_unpickles_untrusted_data():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        found += unsafe_loads(path.read_text(encoding="utf-8"), str(path.relative_to(PACKAGE)))
    assert found == []


def test_the_walk_finds_each_unsafe_form():
    """The walk is a real check: each form it must refuse, written as code would write it, is found."""
    cases = {
        "import torch\ntorch.load(p, weights_only=False)": "without weights_only=True",
        "import torch\ntorch.load(p)": "without weights_only=True",
        "from torch import load\nload(p, map_location='cpu')": "torch.load without",
        "import pickle as p\np.loads(b)": "pickle.loads",
        "import pickle\npickle.Unpickler(f).load()": "pickle.Unpickler",
        "import dill": "imports dill",
        "from joblib import load": "imports from joblib",
        "import numpy as np\nnp.load(f, allow_pickle=True)": "allow_pickle=False",
        "import pandas as pd\npd.read_pickle(f)": "read_pickle",
        "import pickle\nclass U(pickle.Unpickler):\n    pass": "without its own find_class",
        "import pickle\nclass U(pickle.Unpickler):\n    def find_class(self, m, n):\n"
        "        return super().find_class(m, n)": "reaches the real one",
    }
    for source, why in cases.items():
        found = unsafe_loads(source, "case.py")
        assert len(found) == 1 and why in found[0], (source, found)
    safe = ("import torch\ntorch.load(p, map_location='cpu', weights_only=True)\n"
            "import pickle\nclass U(pickle.Unpickler):\n    def find_class(self, m, n):\n        return object\n")
    assert unsafe_loads(safe, "safe.py") == []
