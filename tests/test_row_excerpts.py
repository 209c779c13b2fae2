"""Issue 40 finding 3: a named row's excerpt is decoded whole, redacted, then cut. Before, the first 48
tokens were decoded and cut to 117 characters before redaction: a secret straddling the 48th token
(byte-level BPE) or the character cut kept its first characters, and a WordPiece tokenizer's ``hf _ …``
spacing kept the whole secret. Real tokenizers trained here with the tokenizers library (no downloads)."""
from __future__ import annotations

import pytest
import torch
from boundary_helpers import API_VALUE, HF_TOKEN

from nbguard.step.capture import MicroBatch
from nbguard.watcher.localise.rows import EXCERPT_CHARS, row_excerpt

SECRET_LINE = f"my token is {HF_TOKEN} and api_key={API_VALUE}"
BODY = HF_TOKEN[3:]


def _bpe(corpus: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=["<pad>"],
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>")


def _wordpiece(corpus: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    backend.train_from_iterator(corpus, trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[UNK]", "[PAD]"]))
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]")


def _excerpt(tokenizer, text: str) -> tuple[str, list[int]]:
    ids = tokenizer(text)["input_ids"]
    batch = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}
    mb = MicroBatch(index=0, args=(), kwargs=batch, rng={}, autocast=[])
    excerpt = row_excerpt(tokenizer, mb, 0)
    assert excerpt is not None
    return excerpt, ids


def _pieces(secret: str, n: int = 6) -> list[str]:
    """Every ``n``-character piece of ``secret``: none may survive, at either end of a cut."""
    return [secret[i:i + n] for i in range(len(secret) - n + 1)]


def test_bpe_secret_straddling_the_48th_token_leaves_nothing():
    filler = "a" + " a" * 29  # 30 tokens, 59 characters: the token starts at token 30, ends past token 48
    tokenizer = _bpe(["a a a a a a a a the quick brown fox"] * 50)  # the secret is not in the vocabulary: ~1 token a byte
    text = filler + " " + HF_TOKEN + " and more"
    excerpt, ids = _excerpt(tokenizer, text)
    assert len(ids) > 60 and tokenizer.decode(ids) == text  # a real decode holds it whole
    assert BODY[:10] in tokenizer.decode(ids[:48])  # the 48th token falls inside the secret
    assert not [p for p in _pieces(BODY) if p in excerpt], excerpt
    assert "[REDACTED]" in excerpt and len(excerpt) <= EXCERPT_CHARS


def test_bpe_secret_straddling_the_character_cut_leaves_nothing():
    text = "w" * 85 + " " + SECRET_LINE  # the token starts at character 98: the 117-character cut halves it
    tokenizer = _bpe([text] * 50)  # trained on the row itself: few tokens, far below 48
    excerpt, ids = _excerpt(tokenizer, text)
    assert len(ids) < 48
    assert not [p for p in _pieces(BODY) if p in excerpt], excerpt
    assert len(excerpt) <= EXCERPT_CHARS


def test_wordpiece_spaced_decoding_of_a_token_is_redacted():
    tokenizer = _wordpiece(["the quick brown fox jumps over the lazy dog", SECRET_LINE] * 20)
    excerpt, ids = _excerpt(tokenizer, SECRET_LINE)
    assert f"hf _ {BODY}" in tokenizer.decode(ids)  # WordPiece's own decoding: no secret's shape left
    assert BODY not in excerpt and API_VALUE not in excerpt, excerpt
    assert excerpt.count("[REDACTED]") == 2


@pytest.mark.parametrize("make", [_bpe, _wordpiece])
def test_ordinary_rows_read_as_decoded(make):
    text = "the quick brown fox jumps over the lazy dog, twice: the quick brown fox."
    tokenizer = make([text] * 30)
    excerpt, ids = _excerpt(tokenizer, text)
    assert excerpt == " ".join(tokenizer.decode(ids).split())  # nothing to redact: the decoded text as it is
