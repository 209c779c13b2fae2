"""Tokenizers that do not encode text the way they were saved to.

transformers picks the tokenizer class from tokenizer_config.json, else from the model's config: a
word-level tokenizer.json saved beside a Qwen2 config reloads as ``Qwen2Tokenizer``, which rebuilds a
byte-level BPE from the vocabulary and encodes every text to ``[]`` (SFT then logs loss 0 and grad
norm 0 every step; TRL's EOS on each row hides it from row checks). A class that resolves
differently from the saved one can also give other ids without giving none (transformers#45701).
The rules encode probe strings, and text made of the tokenizer's own vocabulary (so a small
word-level vocabulary is not called broken for not knowing English), with the tokenizer and with
the saved tokenizer.json read by the ``tokenizers`` library itself.
"""
from __future__ import annotations

import os
from typing import Any

from ...introspect.tokenizers import loaded_from, same_tokenizer_class, saved_tokenizer_class
from ..registry import finding, rule

PROBES = ("The capital of France is Paris.", "Order 12345 shipped on 2024-05-06; total $1,299.99!", "hello world")
VOCABULARY_PROBE_TOKENS = 16
# a tokenizer that cannot be called the usual way (no add_special_tokens, no input_ids): nothing to compare
UNENCODABLE = (TypeError, ValueError, KeyError, AttributeError, NotImplementedError)


def _special_ids(tok: Any) -> set[int]:
    ids = set(getattr(tok, "all_special_ids", []) or [])
    decoder = getattr(tok, "added_tokens_decoder", None) or {}
    return ids | {i for i, added in decoder.items() if getattr(added, "special", False)}


def vocabulary_probe(tok: Any) -> str | None:
    """Text decoded from regular tokens spread over the vocabulary: a healthy tokenizer encodes it to real ids."""
    try:
        size = len(tok)
    except TypeError:
        return None
    skipped = set(getattr(tok, "added_tokens_decoder", None) or {}) | _special_ids(tok)
    regular = [i for i in range(size) if i not in skipped]  # ids only: get_vocab() on a 150k vocabulary is slow
    if not regular:
        return None
    step = max(1, len(regular) // VOCABULARY_PROBE_TOKENS)
    words = [tok.decode([i]).strip() for i in regular[::step][:VOCABULARY_PROBE_TOKENS]]
    text = " ".join(w for w in words if w)
    return text or None


def probe_texts(tok: Any) -> list[str]:
    own = vocabulary_probe(tok)
    return [*PROBES, own] if own else list(PROBES)


def encode(tok: Any, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def encodes_nothing(tok: Any) -> dict[str, list[int]] | None:
    """Probe text -> ids when every probe encodes to no ids or to special tokens only (unknown included); else None."""
    specials = _special_ids(tok)
    encoded = {text: encode(tok, text) for text in probe_texts(tok)}
    if any(i not in specials for ids in encoded.values() for i in ids):
        return None
    return encoded


def saved_encodings(folder: str, texts: list[str]) -> dict[str, list[int]] | None:
    """The ids the saved tokenizer.json gives, read by the tokenizers library (no transformers class in between)."""
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(path):
        return None
    from tokenizers import Tokenizer

    try:
        saved = Tokenizer.from_file(path)
    except Exception:  # noqa: BLE001  (a file this tokenizers release cannot read: nothing to compare with)
        return None
    return {text: saved.encode(text, add_special_tokens=False).ids for text in texts}


def _where(tok: Any) -> str:
    folder = loaded_from(tok)
    return f"{type(tok).__name__} loaded from {folder}" if folder else type(tok).__name__


def _why_this_class(tok: Any, folder: str | None, saved_class: str | None) -> str:
    loaded = type(tok).__name__
    if folder and saved_class is None:
        return (f"No tokenizer_config.json in that folder names a class, so transformers chose {loaded} from the "
                "model's config (a word-level tokenizer.json saved beside a Qwen2 config reloads as Qwen2Tokenizer).")
    if saved_class and not same_tokenizer_class(saved_class, loaded):
        return f"It was saved as {saved_class} (tokenizer_config.json) and loaded as {loaded}."
    return (f"Its vocabulary or pre-tokenizer does not match {loaded} (a word-level tokenizer.json reloaded as "
            "Qwen2Tokenizer is one way to get there).")


@rule("tokenizer-encodes-nothing", "error")
def tokenizer_encodes_nothing(ctx):
    """The trainer's tokenizer encodes every probe text (plain sentences and words from its own vocabulary) to no ids or to special tokens only: its class does not match its vocabulary (a word-level tokenizer.json reloaded as Qwen2Tokenizer)."""
    tok = ctx.tokenizer
    if tok is None or not callable(tok):
        return None
    try:
        encoded = encodes_nothing(tok)
    except UNENCODABLE:
        return None
    if encoded is None:
        return None
    folder = loaded_from(tok)
    saved = saved_encodings(folder, list(encoded)) if folder else None
    saved_class = saved_tokenizer_class(folder) if folder else None
    evidence = {"tokenizer_class": type(tok).__name__, "loaded_from": folder or getattr(tok, "name_or_path", None),
                "saved_tokenizer_class": saved_class, "probes": {t[:60]: ids for t, ids in encoded.items()},
                "saved_tokenizer_json_ids": {t[:60]: ids for t, ids in saved.items()} if saved else None}
    saved_note = ""
    if saved and any(saved.values()):
        text, ids = max(saved.items(), key=lambda item: len(set(item[1])))  # the most telling: most distinct ids
        saved_note = (f" The tokenizer.json in that folder, read by the tokenizers library, encodes {text[:40]!r} to "
                      f"{ids[:8]}: the file is fine, the class is wrong.")
    return finding(
        "tokenizer-encodes-nothing",
        f"{type(tok).__name__} encodes every probe text to {'nothing' if not any(encoded.values()) else 'special tokens only'}",
        f"{_where(tok)} turns every probe (plain sentences and words taken from its own vocabulary) into "
        f"{'an empty list of ids' if not any(encoded.values()) else 'special or unknown tokens only'}.{saved_note} "
        "Every training row is then special tokens only: SFT logs loss 0 and grad norm 0 every step, and the "
        f"no-supervised-tokens finding, if present, has this cause. {_why_this_class(tok, folder, saved_class)} "
        "Load the tokenizer as what it is: "
        "PreTrainedTokenizerFast(tokenizer_file=\".../tokenizer.json\", ...), then save it with save_pretrained so "
        "its class is written down.", evidence)


@rule("tokenizer-differs-from-saved", "warning")
def tokenizer_differs_from_saved(ctx):
    """The tokenizer encodes probe texts to other ids than the tokenizer.json it was loaded from (read by the tokenizers library itself), or was loaded as another class than tokenizer_config.json names."""
    tok = ctx.tokenizer
    folder = loaded_from(tok) if tok is not None and callable(tok) else None
    if folder is None:
        return None
    if getattr(getattr(tok, "backend_tokenizer", None), "fix_mistral_regex", None) is True:
        return None  # the Mistral regex fix replaces the saved pre-tokenizer on purpose
    try:
        if encodes_nothing(tok) is not None:
            return None  # tokenizer-encodes-nothing says it, with the saved file's ids
        texts = probe_texts(tok)
        saved = saved_encodings(folder, texts)
        ours = {t: encode(tok, t) for t in saved or {}}
    except UNENCODABLE:
        return None
    saved_class = saved_tokenizer_class(folder)
    loaded_class = type(tok).__name__
    other_class = saved_class is not None and not same_tokenizer_class(saved_class, loaded_class)
    differ = {t: (ours[t], ids) for t, ids in (saved or {}).items() if ours[t] != ids}
    if not differ and not other_class:
        return None
    evidence = {"tokenizer_class": loaded_class, "saved_tokenizer_class": saved_class, "loaded_from": folder,
                "texts_compared": len(saved or {}), "texts_encoded_differently": len(differ),
                "first_difference": ({"text": next(iter(differ))[:60], "ids": next(iter(differ.values()))[0][:12],
                                      "saved_ids": next(iter(differ.values()))[1][:12]} if differ else None)}
    class_note = (f"It was saved as {saved_class} (tokenizer_config.json) and loaded as {loaded_class}. "
                  if other_class else "")
    if not differ:
        return finding(
            "tokenizer-differs-from-saved", f"the tokenizer was saved as {saved_class} and loaded as {loaded_class}",
            f"{class_note}The {len(saved or {})} probe texts compared give the same ids as the saved tokenizer.json, "
            "so the data is tokenised as saved; special-token handling and chat templates may still differ between "
            "the classes.", evidence, severity="info")
    return finding(
        "tokenizer-differs-from-saved",
        f"{loaded_class} encodes {len(differ)} of {len(texts)} probe texts differently from its saved tokenizer.json",
        f"{class_note}{_where(tok)} gives other ids than the tokenizer.json beside it, read by the tokenizers library "
        "(for example "
        f"{evidence['first_difference']['ids']} instead of {evidence['first_difference']['saved_ids']}): the model "
        "is trained on token sequences its embeddings were not made for, and whatever loads the saved files later "
        "(a serving engine, the tokenizers library) reads the data otherwise. Load the tokenizer with the class it "
        "was saved as (AutoTokenizer reads tokenizer_config.json's tokenizer_class; a hand-built tokenizer.json "
        "loads with PreTrainedTokenizerFast(tokenizer_file=...)).", evidence)
