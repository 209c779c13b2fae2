"""The Mistral regex warning called real or harmless: a >100k-token byte-level BPE saved as a pre-5.0 Mistral checkpoint."""
from __future__ import annotations

import json

import pytest
from audit_helpers import make_args
from data_helpers import lm_trainer

import nbguard
from nbguard.explainer import diagnose_warning
from nbguard.testing import tiny_llama

CORPUS = ["Order 12345 shipped on 2024-05-06. Total: $1,299.99", "Don't reply 99 88 7777 hello world\n\n  ok"] * 50
DIGITS = ["Order 12345 shipped on 2024-05-06", "Total: $1,299.99 and 7777 more"]
WORDS = ["hello world ok", "shipped on hello"]


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory):
    """transformers only patches tokenizers above 100,000 tokens: a small trained BPE padded with unused tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>", "<pad>"],
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    spec = json.loads(backend.to_str())
    vocab = spec["model"]["vocab"]
    vocab.update({f"<extra_{i}>": len(vocab) + i for i in range(100_001 - len(vocab))})
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), bos_token="<s>",
                                  eos_token="</s>", pad_token="<pad>")
    path = tmp_path_factory.mktemp("mistral")
    tok.save_pretrained(path)
    (path / "config.json").write_text(json.dumps({"model_type": "mistral", "transformers_version": "4.40.0"}))
    return path


def regex_findings(tmp_path, tok, texts):
    rows = [{"input_ids": tok(t)["input_ids"]} for t in texts]
    trainer = lm_trainer(tiny_llama(vocab_size=512), make_args(tmp_path), rows, tokenizer=tok)
    return [f for f in nbguard.audit(trainer=trainer).findings if f.rule == "mistral-regex-unfixed"]


def test_digits_tokenise_differently_and_the_warning_is_called_real(tmp_path, mistral_dir):
    from transformers import AutoTokenizer

    tok, fixed = AutoTokenizer.from_pretrained(mistral_dir), AutoTokenizer.from_pretrained(mistral_dir, fix_mistral_regex=True)
    assert tok(DIGITS[0])["input_ids"] != fixed(DIGITS[0])["input_ids"]  # the old regex keeps digit runs together
    (f,) = regex_findings(tmp_path, tok, DIGITS)
    assert f.severity.value == "warning" and f.evidence["texts_tokenised_differently"] == 2


def test_plain_words_tokenise_the_same_and_the_warning_is_called_harmless(tmp_path, mistral_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(mistral_dir)
    (f,) = regex_findings(tmp_path, tok, WORDS)
    assert f.severity.value == "info" and f.evidence["texts_tokenised_differently"] == 0


def test_tokenizer_loaded_with_the_fix_stays_quiet(tmp_path, mistral_dir):
    from transformers import AutoTokenizer

    assert not regex_findings(tmp_path, AutoTokenizer.from_pretrained(mistral_dir, fix_mistral_regex=True), DIGITS)


def test_the_warning_has_a_signature(mistral_dir, caplog):
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.enable_propagation()
    try:
        with caplog.at_level("WARNING"):
            AutoTokenizer.from_pretrained(mistral_dir)
    finally:
        hf_logging.disable_propagation()
    (text,) = {r.getMessage() for r in caplog.records if "regex" in r.getMessage()}
    assert diagnose_warning(text, "transformers").signature == "mistral-regex-warning"
