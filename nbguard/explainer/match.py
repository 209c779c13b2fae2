"""Matching error messages the way users paste them.

A message copied from a notebook or an issue arrives re-wrapped (line breaks, runs of spaces),
with its quotes changed (straight, curly, backticks) and with C++ namespaces that differ between
releases (``at::Half`` in older torch, ``c10::Half`` today). Signatures match a normalised form.
"""
from __future__ import annotations

import re

_QUOTES = str.maketrans({"\u2018": "'", "\u2019": "'", "\u201c": "'", "\u201d": "'", '"': "'", "`": "'"})
_SPACE = re.compile(r"\s+")
_NAMESPACE = re.compile(r"\b(?:c10|at)::")


def normalised(text: str) -> str:
    """Lower case, one kind of quote ('), single spaces, no ``c10::``/``at::`` prefixes."""
    return _SPACE.sub(" ", _NAMESPACE.sub("", text.translate(_QUOTES))).strip().lower()


def search(pattern: re.Pattern[str], text: str) -> re.Match[str] | None:
    """``pattern`` (written against the normalised form) searched in the normalised ``text``."""
    return pattern.search(normalised(text))
