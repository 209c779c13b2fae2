"""The tokenizer a Trainer (or a data collator) holds, however the installed transformers names it."""
from __future__ import annotations

from typing import Any


def tokenizer_of(owner: Any) -> Any:
    """``owner.processing_class`` (transformers >= 4.46), else ``owner.tokenizer`` (older Trainers, collators);
    a multimodal processor's own ``tokenizer``. None when it holds none.

    ``tokenizer`` is read only where there is no ``processing_class``: on transformers 4.46-4.x a Trainer's
    ``tokenizer`` is a deprecated property that logs a warning into the user's output and returns
    ``processing_class`` anyway.
    """
    if owner is None:
        return None
    tok = getattr(owner, "processing_class", None)
    if tok is None and not hasattr(owner, "processing_class"):
        tok = getattr(owner, "tokenizer", None)
    return getattr(tok, "tokenizer", tok)  # a multimodal processor carries its tokenizer
