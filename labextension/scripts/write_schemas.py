"""Write nbguard/document/schema.json's event-kind enum from the event-kind registry, then the Lab
extension's TypeScript files from the schemas (scripts/schema-types.mjs). From the repository root:

    python labextension/scripts/write_schemas.py          rewrite what is stale
    python labextension/scripts/write_schemas.py --check  rewrite nothing; exit 1 if a file is stale

A kind is registered at import by the module that owns it (``register_event_kind``), so the registry
is complete only once every such module is imported: the modules are found by reading nbguard's
source for the call, not from a list, so a new owner anywhere in the package is not forgotten.
tests/test_event_kind_schema.py fails when the committed files differ from what this writes.
"""
from __future__ import annotations

import ast
import importlib
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "nbguard"
REGISTER = "register_event_kind"


def _calls_register(tree: ast.AST) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
            if name == REGISTER:
                return True
    return False


def kind_owners() -> list[str]:
    """The nbguard modules whose source calls register_event_kind (the document model included)."""
    owners = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if "labextension" in path.relative_to(PACKAGE).parts:  # the built extension, not Python source
            continue
        if _calls_register(ast.parse(path.read_text(encoding="utf-8"))):
            parts = path.relative_to(ROOT).with_suffix("").parts
            owners.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return owners


def registered_kinds() -> list[str]:
    """Every kind nbguard's own modules register, once all of them are imported."""
    for module in kind_owners():
        importlib.import_module(module)
    from nbguard.document.model import EVENT_KIND_REGISTRY

    return list(EVENT_KIND_REGISTRY)


def main(argv: list[str]) -> int:
    from nbguard.document.schema import SCHEMA_PATH, schema_text_with_kinds

    check = "--check" in argv
    text = schema_text_with_kinds(registered_kinds())
    stale = SCHEMA_PATH.read_text(encoding="utf-8") != text
    where = SCHEMA_PATH.relative_to(ROOT)
    if stale and check:
        print(f"{where} does not list the registered event kinds: run labextension/scripts/write_schemas.py",
              file=sys.stderr)
    elif stale:
        SCHEMA_PATH.write_text(text, encoding="utf-8")
        print(f"wrote {where}")
    node = shutil.which("node")
    if node is None:
        print("node is not installed: the TypeScript files were not checked or written", file=sys.stderr)
        return 1
    types = subprocess.run([node, str(ROOT / "labextension" / "scripts" / "schema-types.mjs"),
                            *(["--check"] if check else [])], cwd=ROOT)
    return 1 if (stale and check) or types.returncode else 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # this tree's nbguard, whatever else is installed
    sys.exit(main(sys.argv[1:]))
