"""The shared vocabulary producers use: the document model and the display mixin.

The model and the ``Displayable`` mixin live in ``nbguard.document`` (the bottom layer; the render
layer registers the formats Displayable shows). This module only gathers them for the auditor, the watch, the explainer and the fixes.
"""
from __future__ import annotations

from .document import (
    CAUSES,
    EVENT_KIND_REGISTRY,
    EVENT_KINDS,
    MIME_TYPE,
    SCHEMA_VERSION,
    Event,
    EventKind,
    Finding,
    FixOffer,
    Origin,
    Severity,
    decode_float,
    document,
    encode_float,
    jsonable,
    register_event_kind,
)
from .document.display import Displayable

__all__ = [
    "CAUSES", "EVENT_KIND_REGISTRY", "EVENT_KINDS", "MIME_TYPE", "SCHEMA_VERSION", "Displayable", "Event", "EventKind",
    "Finding", "FixOffer", "Origin", "Severity", "decode_float", "document", "register_event_kind", "encode_float",
    "jsonable",
]
