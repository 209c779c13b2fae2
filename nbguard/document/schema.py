"""The JSON Schema (draft 2020-12) of the v1 document, ``schema.json`` beside this file.

It is the contract between the kernel and every reader: the report files, the nbconvert exporter
and the JupyterLab extension, whose TypeScript types are generated from it
(``labextension/scripts/schema-types.mjs``).
"""
from __future__ import annotations

import json
from functools import cache
from pathlib import Path

SCHEMA_PATH = Path(__file__).with_name("schema.json")


@cache
def _schema_text() -> str:
    return SCHEMA_PATH.read_text(encoding="utf-8")


def schema() -> dict:
    """The JSON Schema of the v1 document every nbguard payload follows."""
    return json.loads(_schema_text())


COMM_SCHEMA_PATH = Path(__file__).with_name("comm.schema.json")


def comm_schema() -> dict:
    """The JSON Schema of the messages on the "nbguard" comm (kernel <-> Lab extension)."""
    return json.loads(COMM_SCHEMA_PATH.read_text(encoding="utf-8"))
