"""The tokenizer a Trainer (or a data collator) holds, however the installed transformers names it, and the files
it was loaded from."""
from __future__ import annotations

import json
import os
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


def loaded_from(tok: Any) -> str | None:
    """The local folder a tokenizer was loaded from (its ``name_or_path``), None for a hub id or one built in memory."""
    path = str(getattr(tok, "name_or_path", "") or "")
    return path if path and os.path.isdir(path) else None


def saved_tokenizer_class(folder: str) -> str | None:
    """``tokenizer_class`` in the folder's tokenizer_config.json: the class the tokenizer was saved as."""
    try:
        with open(os.path.join(folder, "tokenizer_config.json")) as handle:
            name = json.load(handle).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None
    return name if isinstance(name, str) else None


def same_tokenizer_class(a: str, b: str) -> bool:
    """Class names that denote the same tokenizer across releases: transformers 5 dropped the ``Fast`` twins
    (``LlamaTokenizerFast`` loads as ``LlamaTokenizer``) and ``PreTrainedTokenizerFast`` became ``TokenizersBackend``."""
    def canonical(name: str) -> str:
        name = "TokenizersBackend" if name == "PreTrainedTokenizerFast" else name
        return name[:-4] if name.endswith("Fast") else name

    return canonical(a) == canonical(b)
