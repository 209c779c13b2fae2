"""One line for what a fix changed: counted, never a list of every tensor.

``FixResult.changed`` holds each change (a switch to fp32 lists every parameter with its old and new dtype);
a person reads how many of what changed how, and finds the rest in the result object.
"""
from __future__ import annotations

from collections import Counter
from typing import Any

LINE_LIMIT = 200


def _part(key: Any, value: Any) -> str:
    label = f"{key}: " if key is not None else ""
    if isinstance(value, dict) and value and all(isinstance(v, str) for v in value.values()):
        counts = Counter(value.values())  # parameter -> "float16 -> float32": count each transition
        return label + ", ".join(f"{n} {transition}" for transition, n in counts.most_common())
    if isinstance(value, (dict, list, tuple, set)):
        return f"{label}{len(value)} {'entry' if len(value) == 1 else 'entries'}"
    return f"{label}{value}"


def changed_summary(changed: Any, limit: int = LINE_LIMIT) -> str:
    """``changed`` of a FixResult as one line of at most ``limit`` characters."""
    if not changed:
        return "nothing to change"
    if isinstance(changed, dict) and len(changed) > 3 and all(isinstance(v, str) for v in changed.values()):
        return _part(None, changed)  # name -> "float16 -> float32" for every tensor: counted
    items = changed.items() if isinstance(changed, dict) else [(None, changed)]
    line = "; ".join(_part(key, value) for key, value in items)
    return line if len(line) <= limit else line[: limit - 1].rstrip() + "…"
