"""Merging v1 documents (from result objects, the session, or a saved notebook) into one
"report" document.

A report keeps every watch apart: each becomes an entry of ``watches`` with its own title,
events, history and activations, instead of the top-level ``events``/``history`` a single
watch's document carries. Everything else is concatenated in the order it came (identical
repeats, such as a result displayed twice, are kept once).
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from ..findings import SCHEMA_VERSION, document
from ..render.data import encode_document

LIST_SECTIONS = ("findings", "diagnoses", "fixes_applied")
WATCH_KEYS = ("events", "history", "activations")


def _key(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def check_document(doc: Any, name: str = "doc") -> dict:
    """``doc`` if it looks like a v1 document; a clear error otherwise."""
    if not isinstance(doc, dict):
        raise TypeError(f"{name} must be an nbguard document (dict), got {type(doc).__name__}")
    version = doc.get("schema_version")
    if version is None or "kind" not in doc:
        raise ValueError(f"{name} is not an nbguard document: it has no 'schema_version' and 'kind'")
    if not isinstance(version, int) or version > SCHEMA_VERSION:
        raise ValueError(f"{name} has schema_version {version!r}; this nbguard reads version {SCHEMA_VERSION} "
                         "(upgrade nbguard to read newer reports)")
    return doc


def merge_documents(docs: Iterable[dict], *, title: str | None = None, environment: dict | None = None) -> dict:
    """One "report" document holding every section of ``docs``, in order."""
    merged: dict[str, Any] = {}
    seen: dict[str, set] = {name: set() for name in LIST_SECTIONS}
    watches: list[dict] = []
    watch_keys: set[str] = set()
    watch_index: dict[str, int] = {}  # watch_id -> position: a later display of the same watch replaces it
    fix_cells: dict[str, Any] = {}
    found_env = None
    for doc in docs:
        doc = encode_document(check_document(doc))
        for name in LIST_SECTIONS:
            for item in doc.get(name) or []:
                key = _key(item)
                if key not in seen[name]:
                    seen[name].add(key)
                    merged.setdefault(name, []).append(item)
        for name in ("hardware", "probe", "verification"):
            if doc.get(name) is not None:
                merged[name] = doc[name]  # the latest audit describes the run as it is now
        if isinstance(doc.get("fix_cells"), dict):
            fix_cells.update(doc["fix_cells"])
        if isinstance(doc.get("environment"), dict):
            found_env = doc["environment"]
        entries = list(doc.get("watches") or [])
        if any(doc.get(key) for key in WATCH_KEYS):
            entry = {key: doc[key] for key in WATCH_KEYS if doc.get(key)}
            entry["title"] = doc.get("title") or "Watch"
            if doc.get("watch_id") is not None:
                entry["watch_id"] = doc["watch_id"]
            if doc.get("summary") is not None:
                entry["summary"] = doc["summary"]
            entries.append(entry)
        for entry in entries:
            if not isinstance(entry, dict):
                continue
            wid = entry.get("watch_id")
            if wid is not None and str(wid) in watch_index:
                watches[watch_index[str(wid)]] = entry
            elif _key(entry) not in watch_keys:
                watch_keys.add(_key(entry))
                if wid is not None:
                    watch_index[str(wid)] = len(watches)
                watches.append(entry)
    _number_repeated_titles(watches)
    if "fixes_applied" in merged:
        merged["fixes_applied"].sort(key=lambda f: f.get("time") if isinstance(f.get("time"), (int, float)) else 0)
    sections: dict[str, Any] = {}
    if title:
        sections["title"] = title
    env = environment if environment is not None else found_env
    if env is not None:
        sections["environment"] = env
    for name in ("hardware", "findings", "probe", "verification"):
        if name in merged:
            sections[name] = merged[name]
    if watches:
        sections["watches"] = watches
    for name in ("diagnoses", "fixes_applied"):
        if name in merged:
            sections[name] = merged[name]
    if fix_cells:
        sections["fix_cells"] = fix_cells
    return document("report", **sections)


def _number_repeated_titles(watches: list[dict]) -> None:
    """Watches share a default title; number them ("... (2)") so a reader can tell them apart."""
    titles = [w.get("title") or "Watch" for w in watches]
    for index, watch in enumerate(watches):
        if titles.count(titles[index]) > 1:
            watch["title"] = f"{titles[index]} ({titles[:index + 1].count(titles[index])})"


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
