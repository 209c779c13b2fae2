"""Several v1 documents (a session's timeline, the outputs saved in a notebook) as one "report".

A report tells the story in order: each document becomes one entry of ``entries`` (an audit, a watch,
a fix applied, an explained exception, a verification), so the audit before a fix and the audit after
it both appear. Two rules keep it readable: an entry identical to one already there (a result displayed
twice) is kept once, and a later view of the same watch (same ``watch_id``, e.g. its dashboard
redrawn after training) replaces the earlier one in place. :func:`gather` reads a section across the
entries, for code that wants "every finding" or "every watch" rather than the story.
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from .codec import encode_document
from .model import SCHEMA_VERSION, document
from .view import without_view

ENVELOPE = ("schema_version", "nbguard_version", "output_id", "view")
WATCH_KEYS = ("events", "history", "activations", "skip_streaks")


def _key(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def check_document(doc: Any, name: str = "doc") -> dict:
    """``doc`` (without a displayed bundle's derived ``view``) if it looks like a v1 document; a
    clear error otherwise."""
    if not isinstance(doc, dict):
        raise TypeError(f"{name} must be an nbguard document (dict), got {type(doc).__name__}")
    version = doc.get("schema_version")
    if version is None or "kind" not in doc:
        raise ValueError(f"{name} is not an nbguard document: it has no 'schema_version' and 'kind'")
    if not isinstance(version, int) or version > SCHEMA_VERSION:
        raise ValueError(f"{name} has schema_version {version!r}; this nbguard reads version {SCHEMA_VERSION} "
                         "(upgrade nbguard to read newer reports)")
    return without_view(doc)


def as_entries(doc: dict) -> list[dict]:
    """The entries a document contributes: a report's own entries, else the document itself."""
    if doc.get("kind") == "report" and isinstance(doc.get("entries"), list):
        return [e for e in doc["entries"] if isinstance(e, dict)]
    return [{k: v for k, v in doc.items() if k not in ENVELOPE and k != "environment"}]


def merge_documents(docs: Iterable[dict], *, title: str | None = None, environment: dict | None = None) -> dict:
    """One "report" document whose ``entries`` are ``docs`` in order (see the module docstring)."""
    entries: list[dict] = []
    seen: set[str] = set()
    watch_at: dict[str, int] = {}  # watch_id -> position in entries
    found_env = None
    for doc in docs:
        doc = encode_document(check_document(doc))
        if isinstance(doc.get("environment"), dict):
            found_env = doc["environment"]
        for entry in as_entries(doc):
            wid = entry.get("watch_id")
            if wid is not None and str(wid) in watch_at:
                entries[watch_at[str(wid)]] = entry
                continue
            key = _key({k: v for k, v in entry.items() if k != "time"})
            if key in seen:
                continue
            seen.add(key)
            if wid is not None:
                watch_at[str(wid)] = len(entries)
            entries.append(entry)
    _number_repeated_titles([e for e in entries if _is_watch(e)])
    sections: dict[str, Any] = {}
    if title:
        sections["title"] = title
    env = environment if environment is not None else found_env
    if env is not None:
        sections["environment"] = env
    sections["entries"] = entries
    return document("report", **sections)


def _is_watch(entry: dict) -> bool:
    return any(entry.get(key) for key in WATCH_KEYS) or entry.get("kind") == "watch"


def _number_repeated_titles(watches: list[dict]) -> None:
    """Watches share a default title; number them ("... (2)") so a reader can tell them apart."""
    titles = [w.get("title") or "Watch" for w in watches]
    for index, watch in enumerate(watches):
        if titles.count(titles[index]) > 1:
            watch["title"] = f"{titles[index]} ({titles[:index + 1].count(titles[index])})"


def gather(doc: dict, name: str) -> list:
    """Every item of the list section ``name`` ("findings", "diagnoses", "fixes_applied", ...) across a
    document and its entries, in order; ``name="watches"`` gives each watch as one dict."""
    parts = [doc, *(doc.get("entries") or [])] if isinstance(doc.get("entries"), list) else [doc]
    items: list = []
    for part in parts:
        if not isinstance(part, dict):
            continue
        if name == "watches" and part is not doc and _is_watch(part):
            items.append(part)
        else:
            items.extend(part.get(name) or [])
    return items


def as_document(value: Any, name: str) -> dict:
    """A document from a result object (``to_document()``), a record (``to_dict()``) or a dict."""
    if isinstance(value, dict):
        return check_document(value, name)
    to_document = getattr(value, "to_document", None)
    if callable(to_document):
        return check_document(to_document(), f"{name}.to_document()")
    raise TypeError(f"{name} must be a result with to_document() (an AuditResult, a NanWatch, ...), "
                    f"an nbguard document dict, or None; got {type(value).__name__}")


def diagnosis_document(value: Any) -> dict:
    """A diagnosis as a document: from to_document(), or one to_dict() record, or a dict."""
    if isinstance(value, dict) and "schema_version" in value:
        return check_document(value, "diagnosis")
    if callable(getattr(value, "to_document", None)):
        return check_document(value.to_document(), "diagnosis.to_document()")
    record = value if isinstance(value, dict) else value.to_dict() if callable(getattr(value, "to_dict", None)) else None
    if not isinstance(record, dict):
        raise TypeError(f"a recorded diagnosis must have to_document() or to_dict(); got {type(value).__name__}")
    return document("diagnosis", diagnoses=[record])
