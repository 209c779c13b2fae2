"""schema.json's view definitions and comm.schema.json are the contracts the Lab extension's
TypeScript types are generated from: they must match ``nbguard/document/view.py`` and the messages
``nbguard/notebook/comm.py`` really sends and accepts, or the generated types lie."""
from __future__ import annotations

import dataclasses
import shutil
import subprocess
from pathlib import Path

import pytest
from view_helpers import real_payloads

from nbguard.document import palette as palette_module
from nbguard.document import view as view_module
from nbguard.document.schema import comm_schema, schema

jsonschema = pytest.importorskip("jsonschema")
ROOT = Path(__file__).resolve().parents[1]

VIEW_DEFS = {
    "view": view_module.View, "section": view_module.Section, "fact": view_module.Fact, "fold": view_module.Fold,
    "table": view_module.Table, "verdict": view_module.Verdict, "fixView": view_module.FixView,
    "card": view_module.Card, "chart": view_module.Chart,
}


def validator(full: dict, name: str | None = None):
    """A validator for the whole schema, or for one of its $defs."""
    target = full if name is None else {"$defs": full["$defs"], "$ref": f"#/$defs/{name}"}
    return jsonschema.Draft202012Validator(target)


def test_the_schemas_are_valid_draft_2020_12():
    jsonschema.Draft202012Validator.check_schema(schema())
    jsonschema.Draft202012Validator.check_schema(comm_schema())


@pytest.mark.parametrize("name", sorted(VIEW_DEFS))
def test_each_view_def_has_exactly_the_fields_of_its_dataclass(name):
    definition = schema()["$defs"][name]
    fields = {f.name for f in dataclasses.fields(VIEW_DEFS[name])}
    assert set(definition["properties"]) == fields
    assert set(definition["required"]) == fields  # asdict always writes every field
    assert definition["additionalProperties"] is False


# palette keys added after views were saved in notebooks: optional, so an older saved view stays valid (the
# extension validates the whole payload) and draws without them
ADDED_LATER = {"rewind"}


def test_the_palette_def_has_exactly_the_palette_keys():
    definition = schema()["$defs"]["palette"]
    colors = palette_module.palette()
    assert set(definition["properties"]) == set(colors)  # the view always writes every key
    assert set(definition["required"]) == set(colors) - ADDED_LATER
    assert set(definition["properties"]["severity"]["properties"]) == set(colors["severity"])
    validator(schema(), "palette").validate(colors)


@pytest.mark.parametrize("name", ["audit", "probe", "watch", "diagnosis", "healthy", "report"])
def test_displayed_documents_of_real_runs_follow_the_schema(name):
    data = real_payloads()[name]
    validator(schema()).validate(data)  # the document and its view
    validator(schema(), "view").validate(data["view"])
    assert data["view"] == view_module.view(view_module.without_view(data)).to_dict()


def test_the_schema_rejects_a_view_that_drifted_from_view_py():
    good = real_payloads()["watch"]["view"]
    check = validator(schema(), "view")
    section = next(s for s in good["sections"] if s["charts"])
    drifted = [
        {**good, "subtitle": "x"},  # a field view.py does not have
        {k: v for k, v in good.items() if k != "summary"},  # a field view.py always writes
        {**good, "sections": [{**section, "kind": "charts"}]},  # a section kind view.py never makes
        {**good, "sections": [{**section, "charts": [{**section["charts"][0], "source": [{"a": 1}]}]}]},
        {**good, "palette": {**good["palette"], "nan": "red"}},  # not a #rrggbb colour
    ]
    for bad in drifted:
        with pytest.raises(jsonschema.ValidationError):
            check.validate(bad)


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
def test_the_generated_typescript_types_are_current():
    done = subprocess.run(["node", "scripts/schema-types.mjs", "--check"], cwd=ROOT / "labextension",
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


# -- the comm --------------------------------------------------------------------------------------
class FakeComm:
    """Records what the kernel end sends; stands in for the comm package's Comm."""

    def __init__(self, target_name: str, data: dict):
        self.target_name, self.opened_with, self.sent = target_name, data, []
        self.on_msg_callback = self.on_close_callback = None

    def on_msg(self, callback) -> None:
        self.on_msg_callback = callback

    def on_close(self, callback) -> None:
        self.on_close_callback = callback

    def send(self, data: dict) -> None:
        self.sent.append(data)

    def close(self) -> None:
        pass


@pytest.fixture
def channel(monkeypatch):
    from nbguard.notebook import comm

    monkeypatch.setattr(comm, "_comm_factory", lambda: FakeComm)
    monkeypatch.setattr("nbguard.notebook.display.in_colab", lambda: False)
    lab = comm.LabChannel()
    assert lab.open(type("Shell", (), {"kernel": object()})())
    return lab


def frontend(data: dict) -> dict:
    validator(comm_schema(), "frontendMessage").validate(data)  # the test speaks only the protocol
    return {"content": {"data": data}}


def test_what_the_kernel_sends_follows_the_comm_schema(channel):
    fake = channel.comm
    assert fake.target_name == "nbguard"
    validator(comm_schema(), "kernelHello").validate(fake.opened_with)
    fake.on_msg_callback(frontend({"action": "hello", "extension_version": "0.1.0"}))
    assert channel.present and channel.extension_version == "0.1.0"
    assert channel.insert_cell("x = 1", "out-1", run=True)
    assert channel.insert_cell("y = 2", "out-2")
    for message in fake.sent:
        validator(comm_schema(), "insertCell").validate(message)
        validator(comm_schema(), "kernelMessage").validate(message)
    assert [m["run"] for m in fake.sent] == [True, False]


def test_every_front_end_reply_in_the_schema_reaches_its_request(channel):
    channel.comm.on_msg_callback(frontend({"action": "hello", "extension_version": "0.1.0"}))
    replies: dict[str, list] = {"a": [], "b": [], "c": []}
    for output_id in replies:
        channel.insert_cell("pass", output_id, on_reply=replies[output_id].append)
    channel.comm.on_msg_callback(frontend({"action": "inserted", "output_id": "a", "fallback": None}))
    moved = {"action": "inserted", "output_id": "b", "fallback": "active-cell",
             "message": "no output with output_id \"b\" in this notebook; inserted below the active cell instead"}
    channel.comm.on_msg_callback(frontend(moved))
    channel.comm.on_msg_callback(frontend({"action": "error", "output_id": "c", "message": "read-only"}))
    assert [r["action"] for r in replies["a"] + replies["b"] + replies["c"]] == ["inserted", "inserted", "error"]
    assert replies["b"][0]["fallback"] == "active-cell"
    # an error without output_id can only answer the one request still waiting
    waiting: list = []
    channel.insert_cell("pass", "d", on_reply=waiting.append)
    channel.comm.on_msg_callback(frontend({"action": "error", "message": "nbguard comm: bad request"}))
    assert waiting == [{"action": "error", "message": "nbguard comm: bad request"}]


def test_the_comm_schema_rejects_messages_outside_the_protocol():
    kernel, front = validator(comm_schema(), "kernelMessage"), validator(comm_schema(), "frontendMessage")
    for bad in ({"action": "insert-cell", "code": "x", "output_id": "o"},  # no run
                {"action": "insert-cell", "code": 1, "output_id": "o", "run": False},
                {"action": "hello"}, {"action": "delete-cell", "output_id": "o"}):
        with pytest.raises(jsonschema.ValidationError):
            kernel.validate(bad)
    for bad in ({"action": "inserted", "output_id": "o", "fallback": "somewhere"},
                {"action": "inserted", "output_id": "o"},  # fallback is always said
                {"action": "error"}, {"action": "hello", "nbguard_version": "1"}):
        with pytest.raises(jsonschema.ValidationError):
            front.validate(bad)
