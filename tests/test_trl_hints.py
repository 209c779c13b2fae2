"""Issue 34 item 7 (b): a tokenizer that encodes every prompt to nothing. A word-level tokenizer.json saved beside
a Qwen2 config reloads through AutoTokenizer as Qwen2Tokenizer and encodes every text to []; a real SFTTrainer built
on it trains on rows of special tokens only. The audit names the empty prompts before training; the same vocabulary
loaded as what it is (PreTrainedTokenizerFast) stays quiet."""
from __future__ import annotations

import tempfile

import pytest

import nbguard

pytest.importorskip("trl")

WORDS = ["<unk>", "<pad>", "</s>", "the", "capital", "of", "france", "is", "paris", "italy", "rome"]
ROWS = [{"prompt": "the capital of france is", "completion": " paris"},
        {"prompt": "the capital of italy is", "completion": " rome"}] * 4


def word_level_dir() -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import Qwen2Config

    folder = tempfile.mkdtemp()
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.save(folder + "/tokenizer.json")
    Qwen2Config(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1).save_pretrained(folder)
    return folder


def sft(tok):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from nbguard.testing import tiny_qwen2

    return SFTTrainer(model=tiny_qwen2(vocab_size=16), processing_class=tok, train_dataset=Dataset.from_list(ROWS),
                      args=SFTConfig(output_dir=tempfile.mkdtemp(), use_cpu=True, report_to=[], max_steps=1))


def by_id(report, rule_id):
    return [f for f in report.findings if f.rule == rule_id]


def test_tokenizer_encoding_every_prompt_to_nothing_is_named_before_training():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(word_level_dir())
    assert tok("the capital of france is")["input_ids"] == []  # the trap is real
    tok.pad_token = "<pad>"
    report = nbguard.audit(trainer=sft(tok))
    (found,) = by_id(report, "prompt-encodes-empty")
    assert found.severity.value == "error"
    assert found.evidence["rows_checked"] == 8
    assert found.evidence["rows_empty"]["first"][:2] == [0, 1]
    assert "the capital of france is" in found.evidence["excerpts"]["first"]
    assert not [f for f in report.findings if f.rule == "rule-error"]


def test_same_vocabulary_loaded_as_itself_stays_quiet():
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=word_level_dir() + "/tokenizer.json", pad_token="<pad>",
                                  eos_token="</s>", unk_token="<unk>")
    assert tok("the capital of france is")["input_ids"] == [3, 4, 5, 6, 7]
    report = nbguard.audit(trainer=sft(tok))
    assert by_id(report, "prompt-encodes-empty") == []


def merging_bpe():
    """A byte-level BPE trained here without the pre-tokenizer's regex: "Question: 2+2=4" is one token, so the prompt
    "Question: 2+2=" and its completion "4" merge across the boundary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(["Question: 2+2=4", "Question: 3+3=6", "Question: 1+1=2"] * 50,
                                trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>", "<pad>"],
                                                    initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


@pytest.mark.parametrize("completion, cut", [("4", True), (" 4", False)])
def test_prompt_and_completion_joined_without_a_space_are_named_from_trls_rows(completion, cut):
    """Item 7 (a): TRL warns "The tokenized prompt is not a prefix of the tokenized prompt+completion" once per
    process; prompt-end-not-trained predicts it from the trainer's prepared rows, naming the rows. The completion
    with its separating space is the quiet twin."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from nbguard.testing import tiny_llama

    tok = merging_bpe()
    assert tok.tokenize("Question: 2+2=4")[:1] != tok.tokenize("Question: 2+2=")[:1]  # the merge is real
    rows = [{"prompt": "Question: 2+2=", "completion": completion}, {"prompt": "Question: 3+3=", "completion": "6"},
            {"prompt": "Question: 1+1=", "completion": " 2"}]
    trainer = SFTTrainer(model=tiny_llama(), processing_class=tok, train_dataset=Dataset.from_list(rows),
                         args=SFTConfig(output_dir=tempfile.mkdtemp(), use_cpu=True, report_to=[]))
    found = by_id(nbguard.audit(trainer=trainer), "prompt-end-not-trained")
    assert found[0].evidence["rows_cut"]["first"] == ([0, 1] if cut else [1])
