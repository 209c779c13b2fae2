"""The JSON Schema (draft 2020-12) of the v1 document, ``schema.json`` beside this file.

It is the contract between the kernel and every reader: the report files, the nbconvert exporter
and the JupyterLab extension, whose TypeScript types are generated from it
(``labextension/scripts/schema-types.mjs``).

Its event-kind enum (``$defs.eventKind``) is the event-kind registry (``model.EVENT_KIND_REGISTRY``)
written out: ``labextension/scripts/write_schemas.py`` imports every module that registers a kind and
rewrites it with :func:`schema_text_with_kinds`, then the TypeScript files from the file.
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from functools import cache
from pathlib import Path

from .model import EVENT_KIND_REGISTRY

SCHEMA_PATH = Path(__file__).with_name("schema.json")
# The $def that holds the event kinds; src/validate.ts names it too.
EVENT_KIND_DEF = "eventKind"


@cache
def _schema_text() -> str:
    return SCHEMA_PATH.read_text(encoding="utf-8")


def committed_event_kinds() -> list[str]:
    """The event kinds schema.json lists: every kind nbguard's own modules register, when it is current."""
    return list(json.loads(_schema_text())["$defs"][EVENT_KIND_DEF]["enum"])


def schema() -> dict:
    """The JSON Schema of the v1 document every nbguard payload follows; an event's ``kind`` is any
    kind schema.json lists or registered now (``register_event_kind``: a user's detector adds its own)."""
    data = json.loads(_schema_text())
    listed = data["$defs"][EVENT_KIND_DEF]["enum"]
    listed += [kind for kind in EVENT_KIND_REGISTRY if kind not in listed]
    return data


def schema_text_with_kinds(kinds: Iterable[str]) -> str:
    """schema.json's text with its event-kind enum set to ``kinds`` (sorted: the file does not change with
    the order modules happen to be imported in), formatted as the committed file is."""
    data = json.loads(_schema_text())
    data["$defs"][EVENT_KIND_DEF]["enum"] = sorted(set(kinds))
    return json.dumps(data, indent=2, ensure_ascii=False) + "\n"


COMM_SCHEMA_PATH = Path(__file__).with_name("comm.schema.json")


def comm_schema() -> dict:
    """The JSON Schema of the messages on the "nbguard" comm (kernel <-> Lab extension)."""
    return json.loads(COMM_SCHEMA_PATH.read_text(encoding="utf-8"))
