"""Issue 43 item 3 (b): a tokenizer whose class does not match the tokenizer.json it was loaded from. A word-level
tokenizer.json saved beside a Qwen2 config reloads through AutoTokenizer as Qwen2Tokenizer and encodes every text to
[] (a real SFTTrainer then trains on EOS-only rows, which hides it from the row check); a byte-level BPE saved as
PreTrainedTokenizerFast and loaded as Qwen2Tokenizer gives other ids without giving none. Each is compared with the
saved file read by the tokenizers library; the same files loaded as what they are stay quiet."""
from __future__ import annotations

import pytest
from audit_helpers import make_args
from data_helpers import lm_trainer
from tokenizer_helpers import TEXTS, sft_on_text, word_level_beside_qwen2

import nbguard
from nbguard.testing import tiny_llama, word_tokenizer

NOTHING, DIFFERS = "tokenizer-encodes-nothing", "tokenizer-differs-from-saved"
CORPUS = ["The capital of France is Paris.", "Order 12345 shipped on 2024-05-06; total $1,299.99!",
          "hello world, hello there"] * 30


def found(trainer) -> dict:
    return {f.rule: f for f in nbguard.audit(trainer=trainer).findings}


def test_word_level_tokenizer_reloaded_as_qwen2_is_named_with_where_it_came_from(tmp_path):
    pytest.importorskip("trl")
    from transformers import AutoTokenizer

    folder = word_level_beside_qwen2(tmp_path / "tok")
    tok = AutoTokenizer.from_pretrained(folder)
    tok.pad_token = "<pad>"
    assert tok(TEXTS[0])["input_ids"] == []  # the trap is real
    trainer = sft_on_text(tok, tmp_path / "out")
    assert set(trainer.train_dataset[0]["input_ids"]) == {tok.eos_token_id}  # TRL's EOS is all a row holds
    rules = found(trainer)
    assert "prompt-encodes-empty" not in rules  # the row check sees the appended EOS
    assert rules["no-supervised-tokens"].severity.value == "error"
    assert rules["no-supervised-tokens"].evidence["tokenizer_class"] == "Qwen2Tokenizer"  # the finding names it
    assert f"encoded by Qwen2Tokenizer loaded from {folder}" in rules["no-supervised-tokens"].detail
    f = rules[NOTHING]
    assert f.severity.value == "error" and DIFFERS not in rules
    assert f.evidence["tokenizer_class"] == "Qwen2Tokenizer" and f.evidence["loaded_from"] == folder
    assert "Qwen2Tokenizer loaded from " + folder in f.detail
    assert "No tokenizer_config.json in that folder names a class" in f.detail
    assert all(ids == [] for ids in f.evidence["probes"].values())
    own_words = next(t for t in f.evidence["saved_tokenizer_json_ids"] if "paris" in t)
    assert f.evidence["saved_tokenizer_json_ids"][own_words][-8:] == [3, 4, 5, 6, 7, 8, 9, 10]


def test_the_same_file_loaded_as_what_it_is_stays_quiet(tmp_path):
    pytest.importorskip("trl")
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    folder = word_level_beside_qwen2(tmp_path / "tok")
    tok = PreTrainedTokenizerFast(tokenizer_file=folder + "/tokenizer.json", pad_token="<pad>", eos_token="</s>",
                                  unk_token="<unk>")
    rules = found(sft_on_text(tok, tmp_path / "out"))
    assert NOTHING not in rules and DIFFERS not in rules
    tok.save_pretrained(tmp_path / "saved")  # the remedy: its class is now written down, and AutoTokenizer reads it
    rules = found(sft_on_text(AutoTokenizer.from_pretrained(tmp_path / "saved"), tmp_path / "out"))
    assert NOTHING not in rules and DIFFERS not in rules


def test_the_saved_class_is_named_when_another_class_loads_the_file_to_nothing(tmp_path):
    pytest.importorskip("trl")
    from transformers import PreTrainedTokenizerFast, Qwen2Tokenizer

    folder = word_level_beside_qwen2(tmp_path / "tok")
    PreTrainedTokenizerFast(tokenizer_file=folder + "/tokenizer.json", pad_token="<pad>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(tmp_path / "saved")
    tok = Qwen2Tokenizer.from_pretrained(tmp_path / "saved")
    f = found(sft_on_text(tok, tmp_path / "out"))[NOTHING]
    assert f.evidence["saved_tokenizer_class"] == "TokenizersBackend"
    assert "saved as TokenizersBackend (tokenizer_config.json) and loaded as Qwen2Tokenizer" in f.detail


def test_a_small_vocabulary_that_does_not_know_english_is_not_called_empty(tmp_path):
    tok = word_tokenizer()  # w3..w127: every English probe is <unk>, its own words encode
    trainer = lm_trainer(tiny_llama(), make_args(tmp_path), [{"input_ids": [1, 5, 6, 7, 2]}] * 8, tokenizer=tok)
    assert NOTHING not in found(trainer)


def bpe_saved_as_fast(folder) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "</s>"],
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>").save_pretrained(folder)
    return str(folder)


def rows_of(tok) -> list[dict]:
    return [{"input_ids": tok(t)["input_ids"] + [tok.eos_token_id]} for t in CORPUS[:8]]


def test_a_class_that_resolves_differently_and_gives_other_ids_is_named(tmp_path):
    from transformers import Qwen2Tokenizer

    folder = bpe_saved_as_fast(tmp_path / "tok")
    tok = Qwen2Tokenizer.from_pretrained(folder)  # its own pre-tokenizer over the saved vocabulary and merges
    trainer = lm_trainer(tiny_llama(vocab_size=512), make_args(tmp_path), rows_of(tok), tokenizer=tok)
    f = found(trainer)[DIFFERS]
    assert f.severity.value == "warning"
    assert f.evidence["tokenizer_class"] == "Qwen2Tokenizer" and f.evidence["saved_tokenizer_class"] == "TokenizersBackend"
    assert f.evidence["texts_encoded_differently"] >= 3
    first = f.evidence["first_difference"]
    assert first["ids"] != first["saved_ids"] and first["ids"]  # other ids, not none
    assert "saved as TokenizersBackend" in f.detail and folder in f.detail


def test_the_saved_class_reloaded_by_autotokenizer_stays_quiet(tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(bpe_saved_as_fast(tmp_path / "tok"))
    trainer = lm_trainer(tiny_llama(vocab_size=512), make_args(tmp_path), rows_of(tok), tokenizer=tok)
    rules = found(trainer)
    assert DIFFERS not in rules and NOTHING not in rules


def test_a_mistral_tokenizer_loaded_with_the_regex_fix_stays_quiet(tmp_path):
    """fix_mistral_regex=True replaces the saved pre-tokenizer on purpose: digits encode otherwise than the file."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>", "<pad>"],
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    spec = json.loads(backend.to_str())
    vocab = spec["model"]["vocab"]  # transformers only patches tokenizers above 100,000 tokens
    vocab.update({f"<extra_{i}>": len(vocab) + i for i in range(100_001 - len(vocab))})
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), bos_token="<s>", eos_token="</s>",
                            pad_token="<pad>").save_pretrained(tmp_path / "tok")
    (tmp_path / "tok" / "config.json").write_text(json.dumps({"model_type": "mistral", "transformers_version": "4.40.0"}))
    tok = AutoTokenizer.from_pretrained(tmp_path / "tok", fix_mistral_regex=True)
    assert tok(CORPUS[1])["input_ids"] != Tokenizer.from_file(str(tmp_path / "tok" / "tokenizer.json")).encode(
        CORPUS[1], add_special_tokens=False).ids
    trainer = lm_trainer(tiny_llama(vocab_size=512), make_args(tmp_path), rows_of(tok), tokenizer=tok)
    assert DIFFERS not in found(trainer)
