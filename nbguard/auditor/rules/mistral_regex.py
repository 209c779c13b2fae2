"""The Mistral tokenizer regex warning, called real or harmless by tokenising with and without the fix.

transformers 4.57+ warns "The tokenizer you are loading from ... with an incorrect regex pattern ...
You should set the `fix_mistral_regex=True` flag" for Mistral-family tokenizers saved before 5.0, and
marks the backend ``tokenizer.backend_tokenizer.fix_mistral_regex = False``. Whether the old pattern changes any id depends on the
text (digits, punctuation, line breaks). The rule reloads the tokenizer from its own local files with
``fix_mistral_regex=True`` and compares the ids of the sampled rows' text (a probe string with digits,
punctuation and line breaks when there is no batch).
"""
from __future__ import annotations

from typing import Any

from ..registry import finding, rule

PROBE_TEXT = "Order #12345 shipped on 2024-05-06.\nTotal: $1,299.99 (incl. VAT) -- thanks!\n\n  Don't reply."
SAMPLE_ROWS = 4


def fixed_tokenizer(tok: Any) -> Any | None:
    """The same tokenizer reloaded from its local files with ``fix_mistral_regex=True``; None when not reloadable here."""
    path = getattr(tok, "name_or_path", None)
    if not path:
        return None
    try:
        return type(tok).from_pretrained(path, fix_mistral_regex=True, local_files_only=True)
    except (OSError, ValueError):  # not in a local directory or the hub cache: nothing to compare with offline
        return None


def texts_to_compare(ctx, tok) -> list[str]:
    """The text of the first sampled rows (the data decides whether the old regex matters), else the probe."""
    texts = []
    for batch in ctx.batches[:1]:
        ids = batch.get("input_ids")
        if ids is not None and ids.dim() == 2:
            texts += tok.batch_decode(ids[:SAMPLE_ROWS], skip_special_tokens=True)
    return texts or [PROBE_TEXT]


def loaded_without_fix(tok: Any) -> bool:
    """transformers flagged the tokenizer as Mistral's and it was loaded without the fix (the flag sits on the
    backend tokenizer in 5.x, on the tokenizer itself in 4.57)."""
    flag = getattr(getattr(tok, "backend_tokenizer", None), "fix_mistral_regex", None)
    return (flag if flag is not None else getattr(tok, "fix_mistral_regex", None)) is False


@rule("mistral-regex-unfixed", "warning")
def mistral_regex_unfixed(ctx):
    """A Mistral-family tokenizer loaded without fix_mistral_regex: does the pattern change any id of the data?"""
    tok = ctx.tokenizer
    if tok is None or not loaded_without_fix(tok):
        return None
    fixed = fixed_tokenizer(tok)
    if fixed is None:
        return None
    texts = texts_to_compare(ctx, tok)
    differ = [t for t in texts if tok(t, add_special_tokens=False)["input_ids"]
              != fixed(t, add_special_tokens=False)["input_ids"]]
    evidence = {"texts_compared": len(texts), "texts_tokenised_differently": len(differ),
                "first_differing_text": differ[0][:80] if differ else None, "tokenizer": tok.name_or_path}
    if not differ:
        return finding(
            "mistral-regex-unfixed", "the Mistral regex warning is harmless for this data",
            f"The tokenizer was loaded without fix_mistral_regex (transformers warned about its regex), but the "
            f"{len(texts)} text(s) compared ({'sampled rows' if ctx.batches else 'a probe with digits and punctuation'}) give "
            "the same ids with and without the fix.", evidence, severity="info")
    return finding(
        "mistral-regex-unfixed", f"the Mistral regex warning is real: {len(differ)} of {len(texts)} texts tokenise differently",
        "The tokenizer was loaded without fix_mistral_regex, and its pre-tokenizer regex splits these texts "
        "differently from the pattern the model was trained with: the model sees token sequences it never saw in "
        "pre-training. Reload the tokenizer with AutoTokenizer.from_pretrained(..., fix_mistral_regex=True) before "
        "building the dataset.", evidence)
