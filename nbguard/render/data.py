"""Reading a v1 document safely: JSON encoding, non-finite numbers, and the watch sections.

Renderers take documents from many producers (and from saved notebooks), so nothing here
trusts the shape: missing sections are skipped and odd values are shown as text.
"""
from __future__ import annotations

import enum
import json
import math
from collections.abc import Iterator
from typing import Any

from ..findings import MIME_TYPE, SCHEMA_VERSION, encode_float

__all__ = ["MIME_TYPE", "SCHEMA_VERSION", "encode_document", "as_float", "watch_sections", "fmt_num"]


_PLAIN = frozenset({float, int, str, bool, type(None)})


def encode_document(value: Any) -> Any:
    """``value`` as plain JSON data: non-finite floats as "nan"/"inf"/"-inf", numpy and torch
    scalars and arrays as numbers and lists, tuples as lists, anything else by its printed form.

    The result always passes ``json.dumps(..., allow_nan=False)``.
    """
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return encode_float(value)
    if isinstance(value, enum.Enum):
        return encode_document(value.value)
    if isinstance(value, dict):
        return {str(encode_document(k) if not isinstance(k, str) else k): encode_document(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        if all(type(v) in _PLAIN for v in value):  # a row of a history: the fast path
            return [v if type(v) is not float or math.isfinite(v) else encode_float(v) for v in value]
        return [encode_document(v) for v in value]
    # numpy / torch values without importing either: scalars have .item(), arrays .tolist()
    if hasattr(value, "tolist") and callable(value.tolist):
        try:
            return encode_document(value.tolist())
        except Exception:
            pass
    if hasattr(value, "to_dict") and callable(value.to_dict):
        return encode_document(value.to_dict())
    return str(value)


def check_json(doc: Any) -> str:
    """The JSON text of an encoded document; raises ValueError if it is not strict JSON."""
    return json.dumps(doc, allow_nan=False)


def as_float(value: Any) -> float | None:
    """A cell value as a float (None for missing); accepts numbers and "nan"/"inf"/"-inf"."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def fmt_num(value: Any, digits: int = 4) -> str:
    """A compact, human form of a number that may be non-finite or missing."""
    number = as_float(value)
    if number is None:
        return "—" if value is None else str(value)
    if math.isnan(number):
        return "NaN"
    if math.isinf(number):
        return "Inf" if number > 0 else "-Inf"
    if number == int(number) and abs(number) < 1e15:
        return str(int(number))
    return f"{number:.{digits}g}"


def watch_sections(doc: dict) -> Iterator[dict]:
    """Each watch in ``doc`` as {"title", "events", "history", "activations"}.

    A report holds a list under "watches"; a single watch's document carries its "events",
    "history" and "activations" at the top level. Both are read, in that order.
    """
    watches = doc.get("watches")
    if isinstance(watches, list):
        for index, watch in enumerate(watches):
            if isinstance(watch, dict):
                yield {
                    "title": watch.get("title") or f"Watch {index + 1}",
                    "events": watch.get("events") or [],
                    "history": watch.get("history"),
                    "activations": watch.get("activations"),
                    "summary": watch.get("summary"),
                }
    top = {key: doc.get(key) for key in ("events", "history", "activations")}
    if any(top.values()):
        yield {
            "title": None,
            "events": top["events"] or [],
            "history": top["history"],
            "activations": top["activations"],
            "summary": doc.get("summary"),
        }


def history_overview(history: dict | None) -> dict[str, Any]:
    """The numbers a reader wants first from a grad-norm history: size, skipped steps and
    the first non-finite cell (step and group)."""
    if not isinstance(history, dict):
        return {}
    import numpy as np

    from .grid import decode_grid

    groups = [str(g) for g in history.get("groups") or []]
    steps = list(history.get("steps") or [])
    values, missing = decode_grid(history.get("grad_norm"), len(groups), len(steps))
    bad = ~np.isfinite(values) & ~missing
    first_bad = None
    if bad.any():
        cols = np.flatnonzero(bad.any(axis=0))
        col = int(cols[0])
        rows = np.flatnonzero(bad[:, col])
        row = int(rows[0])
        first_bad = (steps[col], groups[row], fmt_num(float(values[row, col])), int(rows.size))
    loss = [as_float(v) for v in history.get("loss") or []]
    finite_loss = [v for v in loss if v is not None and math.isfinite(v)]
    return {
        "n_groups": len(groups),
        "n_steps": len(steps),
        "first_step": steps[0] if steps else None,
        "last_step": steps[-1] if steps else None,
        "skipped_steps": list(history.get("skipped_steps") or []),
        "first_nonfinite": first_bad,
        "nonfinite_cells": int(bad.sum()),
        "nonfinite_loss_steps": [s for s, v in zip(steps, loss) if v is not None and not math.isfinite(v)],
        "loss_first": finite_loss[0] if finite_loss else None,
        "loss_last": finite_loss[-1] if finite_loss else None,
    }


def pretty_json(value: Any, indent: int = 0) -> str:
    """Indented JSON whose lists of plain values stay on one line (shapes, ranges, versions)."""
    pad, inner = "  " * indent, "  " * (indent + 1)
    if isinstance(value, dict) and value:
        items = [f"{inner}{json.dumps(str(k), ensure_ascii=False)}: {pretty_json(v, indent + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(value, (list, tuple)) and value:
        if all(not isinstance(v, (dict, list, tuple)) for v in value):
            return json.dumps(list(value), ensure_ascii=False, default=str)
        return "[\n" + ",\n".join(inner + pretty_json(v, indent + 1) for v in value) + "\n" + pad + "]"
    return json.dumps(value, ensure_ascii=False, default=str)


def heading(doc: dict) -> str:
    """The document's heading: its own title (they already say "nbguard ..."), else its kind."""
    title = doc.get("title")
    return str(title) if title else f"nbguard {doc.get('kind', 'document')}"
