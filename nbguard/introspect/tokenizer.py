"""The tokenizer a Trainer holds, for the audit (ids beyond the embedding) and the fixes (resize to it)."""
from __future__ import annotations

from typing import Any


def tokenizer_of(trainer: Any) -> Any:
    """The tokenizer the Trainer holds (processing_class; tokenizer in older releases), or None."""
    for attr in ("processing_class", "tokenizer"):
        tok = getattr(trainer, attr, None)
        if tok is not None and hasattr(tok, "__len__"):
            inner = getattr(tok, "tokenizer", None)  # a processor wraps the tokenizer
            return inner if inner is not None and hasattr(inner, "__len__") else tok
    return None
