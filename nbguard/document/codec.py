"""JSON encoding of document values: non-finite floats as strings, numpy/torch values as plain data.

JSON has no spelling for NaN or Infinity, so every nbguard document writes them as the strings
``"nan"``, ``"inf"`` and ``"-inf"``; :func:`as_float` reads them back. Nothing here imports numpy
or torch: their values are recognised by ``tolist()``/``item()``.
"""
from __future__ import annotations

import enum
import json
import math
from typing import Any

_PLAIN = frozenset({float, int, str, bool, type(None)})


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


def jsonable(value: Any) -> Any:
    """Evidence values as JSON-safe data (floats encoded, tuples to lists, enums by value,
    dtypes/devices/versions by their printed form, which is what a reader wants)."""
    if isinstance(value, float):
        return encode_float(value)
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [jsonable(v) for v in value]
    if value is None or isinstance(value, (str, int, bool)):
        return value
    if hasattr(value, "to_dict"):
        return value.to_dict()
    return str(value)


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
        return {k if isinstance(k, str) else str(encode_document(k)): encode_document(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        if all(type(v) in _PLAIN for v in value):  # a row of a history: the fast path
            return [v if type(v) is not float or math.isfinite(v) else encode_float(v) for v in value]
        return [encode_document(v) for v in value]
    # numpy / torch values without importing either: scalars and arrays have .tolist()
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
    pad, inner = "  " * indent, "  " * (indent + 1)
    if isinstance(value, dict) and value:
        items = [f"{inner}{json.dumps(str(k), ensure_ascii=False)}: {pretty_json(v, indent + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(value, (list, tuple)) and value:
        if all(not isinstance(v, (dict, list, tuple)) for v in value):
            return json.dumps(list(value), ensure_ascii=False, default=str)
        return "[\n" + ",\n".join(inner + pretty_json(v, indent + 1) for v in value) + "\n" + pad + "]"
    return json.dumps(value, ensure_ascii=False, default=str)
