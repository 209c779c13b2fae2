"""schema.json's event-kind enum, and the TypeScript generated from it, are the event-kind registry
written out by labextension/scripts/write_schemas.py: a module that registers a kind where nobody
regenerated them fails here (rerun the script and commit what it writes)."""
from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

from nbguard.document.model import EVENT_KIND_REGISTRY, EventKind
from nbguard.document.schema import SCHEMA_PATH, committed_event_kinds, schema_text_with_kinds

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "labextension" / "src"
WRITER = ROOT / "labextension" / "scripts" / "write_schemas.py"


def writer():
    spec = importlib.util.spec_from_file_location("nbguard_write_schemas", WRITER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def typescript_union() -> list[str]:
    """The members of src/schema.ts's ``export type EventKind = "a" | "b";``."""
    text = (SRC / "schema.ts").read_text(encoding="utf-8")
    [members] = re.findall(r"^export type EventKind = (.+);$", text, re.M)
    return re.findall(r'"([^"]+)"', members)


def typescript_schema_kinds() -> list[str]:
    """The event kinds of the schema src/documentSchema.ts holds as data (what validate.ts walks)."""
    text = (SRC / "documentSchema.ts").read_text(encoding="utf-8")
    data = json.loads(text[text.index("= {") + 2:text.rindex(";")])
    return data["$defs"]["eventKind"]["enum"]


def kinds_registered_by(module_name: str) -> list[str]:
    """The kinds one module registers, read off its register_event_kind calls (a literal or a module constant)."""
    module = importlib.import_module(module_name)
    kinds = []
    for node in ast.walk(ast.parse(Path(module.__file__).read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == writer().REGISTER:
            first = node.args[0]
            if isinstance(first, ast.Constant):
                kinds.append(first.value)
            elif isinstance(first, ast.Name) and isinstance(getattr(module, first.id, None), str):
                kinds.append(getattr(module, first.id))
    return kinds


def fresh_registered_kinds() -> list[str]:
    """What the script registers in a process of its own: other tests register kinds of their own (a user's
    detector, as the detector guide does), which would not be nbguard's."""
    code = "import json, runpy, sys; print(json.dumps(runpy.run_path(sys.argv[1])['registered_kinds']()))"
    done = subprocess.run([sys.executable, "-c", code, str(WRITER)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, check=True)
    return json.loads(done.stdout)


def test_the_committed_schema_and_typescript_are_what_the_registry_generates():
    kinds = fresh_registered_kinds()
    assert SCHEMA_PATH.read_text(encoding="utf-8") == schema_text_with_kinds(kinds)
    assert typescript_union() == typescript_schema_kinds() == committed_event_kinds() == sorted(kinds)


def test_a_kind_registered_by_a_watcher_module_is_in_the_committed_schema_and_typescript():
    owners = [m for m in writer().kind_owners() if m.startswith("nbguard.watcher.")]
    watcher_kinds = [kind for owner in owners for kind in kinds_registered_by(owner)]
    assert "rewind" in watcher_kinds and "stall" in watcher_kinds  # the scan finds the owners it must
    assert all(kind in EVENT_KIND_REGISTRY for kind in watcher_kinds)
    for listed in (committed_event_kinds(), typescript_union(), typescript_schema_kinds()):
        assert set(watcher_kinds) <= set(listed)


def test_a_new_kind_nobody_regenerated_for_is_caught(monkeypatch):
    monkeypatch.setitem(EVENT_KIND_REGISTRY, "loss-plateau", EventKind("loss-plateau", "the loss stayed flat"))
    generated = schema_text_with_kinds(writer().registered_kinds())
    assert "loss-plateau" in json.loads(generated)["$defs"]["eventKind"]["enum"]
    assert generated != SCHEMA_PATH.read_text(encoding="utf-8")
    assert writer().main(["--check"]) == 1  # and the script's check says so


def test_the_run_time_schema_lists_every_committed_kind_and_those_registered_since():
    # a fresh process that never imported the watcher: a saved watch's "rewind" event still follows schema()
    code = ("import json, sys; from nbguard.document import register_event_kind; "
            "from nbguard.document.schema import schema; "
            "register_event_kind('loss-plateau', 'the loss stayed flat'); "
            "print(json.dumps([schema()['$defs']['eventKind']['enum'], 'nbguard.watcher' in sys.modules]))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          check=True)
    enum, watcher_imported = json.loads(done.stdout)
    assert not watcher_imported
    assert enum == [*committed_event_kinds(), "loss-plateau"] and "rewind" in enum
