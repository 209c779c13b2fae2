"""The shared vocabulary producers use: the document model and the display mixin.

The model itself lives in ``nbguard.document`` (the bottom layer); ``Displayable`` lives with the
renderers. This module only gathers them for the auditor, the watch, the explainer and the fixes.
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
    Origin,
    Severity,
    decode_float,
    document,
    encode_float,
    jsonable,
    register_event_kind,
)
from .render.displayable import Displayable

__all__ = [
    "CAUSES", "EVENT_KIND_REGISTRY", "EVENT_KINDS", "MIME_TYPE", "SCHEMA_VERSION", "Displayable", "Event", "EventKind", "Finding", "Origin",
    "Severity", "decode_float", "document", "register_event_kind", "encode_float", "jsonable",
]
