"""The JSON Schema (draft 2020-12) of the v1 document, ``schema.json`` beside this file.

It is the contract between the kernel and every reader: the report files, the nbconvert exporter
and the JupyterLab extension, whose TypeScript types are generated from it
(``labextension/scripts/schema-types.mjs``).
"""
from __future__ import annotations

import json
from functools import cache
from pathlib import Path

from .model import EVENT_KIND_REGISTRY

SCHEMA_PATH = Path(__file__).with_name("schema.json")


@cache
def _schema_text() -> str:
    return SCHEMA_PATH.read_text(encoding="utf-8")


def schema() -> dict:
    """The JSON Schema of the v1 document every nbguard payload follows; an event's ``kind`` is any
    kind registered now (``register_event_kind``: detectors add their own), not only the built-in ones."""
    data = json.loads(_schema_text())
    _registered_kinds(data)
    return data


def _registered_kinds(node: object) -> None:
    if isinstance(node, dict):
        enum = node.get("enum")
        if isinstance(enum, list) and "nonfinite-loss" in enum and "watch-error" in enum:
            node["enum"] = list(EVENT_KIND_REGISTRY)
        for value in node.values():
            _registered_kinds(value)
    elif isinstance(node, list):
        for value in node:
            _registered_kinds(value)


COMM_SCHEMA_PATH = Path(__file__).with_name("comm.schema.json")


def comm_schema() -> dict:
    """The JSON Schema of the messages on the "nbguard" comm (kernel <-> Lab extension)."""
    return json.loads(COMM_SCHEMA_PATH.read_text(encoding="utf-8"))
