"""JSON encoding of document values: non-finite floats as strings, numpy/torch values as plain data.

JSON has no spelling for NaN or Infinity, so every nbguard document writes them as the strings
``"nan"``, ``"inf"`` and ``"-inf"``; :func:`as_float` reads them back. Nothing here imports numpy
or torch: their values are recognised by ``tolist()``/``item()``.

The limits of a document are defined here, once (``labextension/src/limits.ts`` mirrors them, and a
test compares the two): nesting depth, items in one list, groups x steps of one grid, and bytes.
A document is *built* within them (:func:`encode_document` and :func:`jsonable` cut what is deeper or
longer, saying so in the data), *saved* within them (:func:`check_json`) and *loaded* only within
them (:func:`check_limits`, which the nbconvert exporter, the grid decoder and the Lab run before
anything else): an over-limit document is refused with a :class:`DocumentLimitError` naming the limit.
"""
from __future__ import annotations

import enum
import json
import math
import re
from typing import Any

_PLAIN = frozenset({float, int, str, bool, type(None)})

# ---- limits (mirrored in labextension/src/limits.ts) ---------------------------------------------
MAX_DEPTH = 64  # nested objects/lists; a view is ~12 deep, evidence a few levels more
MAX_LIST = 100_000  # items in one list (a history holds at most its capacity, 2048 steps by default)
MAX_GRID_CELLS = 8_388_608  # groups x steps of one history grid (4096 groups x 2048 steps)
MAX_DOCUMENT_BYTES = 64 * 1024 * 1024  # the JSON text of one document
LIMITS = {"MAX_DEPTH": MAX_DEPTH, "MAX_LIST": MAX_LIST, "MAX_GRID_CELLS": MAX_GRID_CELLS,
          "MAX_DOCUMENT_BYTES": MAX_DOCUMENT_BYTES}
DEEPER = f"(nested deeper than {MAX_DEPTH} levels: not kept)"


class DocumentLimitError(ValueError):
    """A document over one of nbguard's document limits; the message names the limit and where."""


def _where(path: list) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path[:12]) or "the document"


def check_limits(doc: Any, nbytes: int | None = None) -> None:
    """Raise :class:`DocumentLimitError` when ``doc`` (parsed JSON) is over a limit; one iterative pass,
    linear in the document's size (no recursion, so any nesting is refused rather than crashing)."""
    if nbytes is not None and nbytes > MAX_DOCUMENT_BYTES:
        raise DocumentLimitError(f"the nbguard document is {nbytes} bytes, over the limit of {MAX_DOCUMENT_BYTES} "
                                 "bytes (MAX_DOCUMENT_BYTES)")
    stack: list[tuple[Any, int, list]] = [(doc, 1, [])]
    while stack:
        node, depth, path = stack.pop()
        if not isinstance(node, (dict, list)):
            continue
        if depth > MAX_DEPTH:
            raise DocumentLimitError(f"the nbguard document is nested deeper than the limit of {MAX_DEPTH} levels "
                                     f"(MAX_DEPTH) at {_where(path)}")
        if isinstance(node, list):
            if len(node) > MAX_LIST:
                raise DocumentLimitError(f"a list of the nbguard document holds {len(node)} items, over the limit of "
                                         f"{MAX_LIST} (MAX_LIST) at {_where(path)}")
            if not set(map(type, node)) <= _PLAIN:  # a row of plain values (a grid's) has nothing below it
                stack.extend((v, depth + 1, path + [i]) for i, v in enumerate(node) if isinstance(v, (dict, list)))
            continue
        groups, steps = node.get("groups"), node.get("steps")
        if isinstance(groups, list) and isinstance(steps, list) and len(groups) * len(steps) > MAX_GRID_CELLS:
            raise DocumentLimitError(f"a history of the nbguard document is {len(groups)} groups x {len(steps)} steps "
                                     f"= {len(groups) * len(steps)} cells, over the limit of {MAX_GRID_CELLS} cells "
                                     f"(MAX_GRID_CELLS) at {_where(path)}")
        stack.extend((v, depth + 1, path + [k]) for k, v in node.items() if isinstance(v, (dict, list)))


_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_JSON_BRACKET = re.compile(rb"[\[\]{}]")


def json_depth(text: bytes | str) -> int:
    """The deepest nesting of ``[``/``{`` in JSON text (strings skipped), in one linear pass: checked before
    ``json.loads``, which recurses."""
    data = text.encode("utf-8") if isinstance(text, str) else text
    depth = deepest = 0
    for m in _JSON_BRACKET.finditer(_JSON_STRING.sub(b'""', data)):
        if m.group() in (b"[", b"{"):
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


def load_document_text(text: str | bytes) -> Any:
    """A saved document's JSON text, parsed only within the limits (bytes, then nesting, then the rest)."""
    size = len(text.encode("utf-8") if isinstance(text, str) else text)
    if size > MAX_DOCUMENT_BYTES:
        check_limits(None, size)
    depth = json_depth(text)
    if depth > MAX_DEPTH:
        raise DocumentLimitError(f"the nbguard document is nested {depth} levels deep, over the limit of {MAX_DEPTH} "
                                 "levels (MAX_DEPTH)")
    doc = json.loads(text)
    check_limits(doc)
    return doc


def _cut(items: list, total: int) -> list:
    """A list of ``total`` items, cut to MAX_LIST with its last item saying how many were left out."""
    if total <= MAX_LIST:
        return items
    return items[:MAX_LIST - 1] + [f"(… {total - MAX_LIST + 1} more items: nbguard keeps {MAX_LIST} per list)"]


def encode_float(value: float | None) -> float | str | None:
    """A float as JSON can carry it: non-finite values become strings."""
    if value is None:
        return None
    value = float(value)
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return value


def decode_float(value: float | str | None) -> float | None:
    """The inverse of :func:`encode_float`."""
    if value is None:
        return None
    return float(value)  # float("nan"), float("inf"), float("-inf") parse the strings


def jsonable(value: Any, _depth: int = 0) -> Any:
    """Evidence values as JSON-safe data (floats encoded, tuples to lists, enums by value,
    dtypes/devices/versions by their printed form, which is what a reader wants); nesting past
    MAX_DEPTH and list items past MAX_LIST are cut, with a string saying so."""
    if isinstance(value, float):
        return encode_float(value)
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (dict, list, tuple, set)) and _depth >= MAX_DEPTH:
        return DEEPER
    if isinstance(value, dict):
        return {str(k): jsonable(v, _depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        items = list(value)
        return _cut([jsonable(v, _depth + 1) for v in items[:MAX_LIST - 1 if len(items) > MAX_LIST else None]], len(items))
    if value is None or isinstance(value, (str, int, bool)):
        return value
    if hasattr(value, "to_dict"):
        return value.to_dict()
    return str(value)


def encode_document(value: Any, _depth: int = 0) -> Any:
    """``value`` as plain JSON data: non-finite floats as "nan"/"inf"/"-inf", numpy and torch
    scalars and arrays as numbers and lists, tuples as lists, anything else by its printed form.
    Built within the limits: nesting past MAX_DEPTH and list items past MAX_LIST are cut, with a
    string saying so (a history's grid is checked whole by :func:`check_limits`).

    The result always passes ``json.dumps(..., allow_nan=False)``.
    """
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return encode_float(value)
    if isinstance(value, enum.Enum):
        return encode_document(value.value, _depth)
    if isinstance(value, (dict, list, tuple, set, frozenset)) and _depth >= MAX_DEPTH:
        return DEEPER
    if isinstance(value, dict):
        return {k if isinstance(k, str) else str(encode_document(k)): encode_document(v, _depth + 1)
                for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        total = len(value)
        if total > MAX_LIST:
            value = list(value)[:MAX_LIST - 1]
        if all(type(v) in _PLAIN for v in value):  # a row of a history: the fast path
            return _cut([v if type(v) is not float or math.isfinite(v) else encode_float(v) for v in value], total)
        return _cut([encode_document(v, _depth + 1) for v in value], total)
    # numpy / torch values without importing either: scalars and arrays have .tolist()
    if hasattr(value, "tolist") and callable(value.tolist):
        try:
            return encode_document(value.tolist(), _depth)
        except Exception:
            pass
    if hasattr(value, "to_dict") and callable(value.to_dict):
        return encode_document(value.to_dict(), _depth)
    return str(value)


def check_json(doc: Any) -> str:
    """The JSON text of an encoded document; raises ValueError if it is not strict JSON, and
    :class:`DocumentLimitError` if it is over a document limit (what would be saved, refused)."""
    check_limits(doc)
    text = json.dumps(doc, allow_nan=False)
    if len(text) > MAX_DOCUMENT_BYTES:
        check_limits(None, len(text.encode("utf-8")))
    return text


def as_float(value: Any) -> float | None:
    """A document value as a float (None for missing); accepts numbers and "nan"/"inf"/"-inf"."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def pretty_json(value: Any, indent: int = 0) -> str:
    """Indented JSON whose lists of plain values stay on one line (shapes, ranges, versions)."""
    if indent >= MAX_DEPTH and isinstance(value, (dict, list, tuple)) and value:
        return json.dumps(DEEPER)
    pad, inner = "  " * indent, "  " * (indent + 1)
    if isinstance(value, dict) and value:
        items = [f"{inner}{json.dumps(str(k), ensure_ascii=False)}: {pretty_json(v, indent + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(value, (list, tuple)) and value:
        if all(not isinstance(v, (dict, list, tuple)) for v in value):
            return json.dumps(list(value), ensure_ascii=False, default=str)
        return "[\n" + ",\n".join(inner + pretty_json(v, indent + 1) for v in value) + "\n" + pad + "]"
    return json.dumps(value, ensure_ascii=False, default=str)
