"""The nbguard v1 document: the bottom layer every producer writes and every view reads.

- ``model``: the typed results (Finding, Event, Origin, Severity) and the envelope (``document``);
- ``codec``: JSON encoding of non-finite floats and numpy/torch values;
- ``schema``: the JSON Schema, from which the Lab extension's TypeScript types are generated;
- ``redact``: secrets out of anything displayed or saved;
- ``merge``: several documents (a session, a saved notebook) into one report, in order;
- ``view``: the presentation model every renderer formats (sections, order, counts, spelling);
- ``palette``: the colours of severities and of NaN/Inf/skipped cells, for matplotlib and the canvas.

Nothing here imports another part of nbguard, torch, or (at import time) numpy.
"""
from __future__ import annotations

from .codec import as_float, check_json, decode_float, encode_document, encode_float, jsonable, pretty_json
from .model import (
    CAUSES,
    EVENT_KIND_REGISTRY,
    EVENT_KINDS,
    MIME_TYPE,
    SCHEMA_VERSION,
    Event,
    EventKind,
    Finding,
    Origin,
    Severity,
    __version__,
    document,
    register_event_kind,
)

__all__ = [
    "CAUSES", "EVENT_KIND_REGISTRY", "EVENT_KINDS", "MIME_TYPE", "SCHEMA_VERSION", "Event", "EventKind", "Finding", "Origin", "Severity",
    "__version__", "as_float", "check_json", "decode_float", "document", "register_event_kind", "encode_document", "encode_float",
    "jsonable", "pretty_json",
]
