"""TRL's "tokenized prompt is not a prefix" warning, raised by a real SFTTrainer on prompt-completion rows, explained
under the cell, and the fix the explanation writes applied as written: the warning is gone and every training
sequence starts with the whole prompt."""
from __future__ import annotations

import logging
import re
import tempfile

import pytest
from IPython.core.interactiveshell import InteractiveShell
from notebook_helpers import run

import nbguard
from nbguard.explainer import diagnose_warning

pytest.importorskip("trl")

CORPUS = ["The capital of France is Paris.", "The capital of Italy is Rome.", "The capital of Spain is Madrid."] * 50
ROWS = [{"prompt": "The capital of France is ", "completion": "Paris."},
        {"prompt": "The capital of Italy is ", "completion": "Rome."}]

SETUP = """
import tempfile
from datasets import Dataset
from trl import SFTConfig, SFTTrainer
from nbguard.testing import tiny_llama

def sft(dataset):
    return SFTTrainer(model=tiny_llama(), processing_class=tok, train_dataset=dataset,
                      args=SFTConfig(output_dir=tempfile.mkdtemp(), use_cpu=True, report_to=[]))
"""


def byte_level_tokenizer():
    """A byte-level BPE trained here: " Paris" is one token, so "is " + "Paris" merges across the boundary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=600, special_tokens=["<s>", "</s>", "<pad>"],
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


@pytest.fixture(autouse=True)
def fresh_warning_once():
    """TRL warns through accelerate's ``warning_once``, cached per message for the whole process."""
    from accelerate.logging import MultiProcessAdapter

    MultiProcessAdapter.warning_once.cache_clear()


@pytest.fixture
def shell():
    ip = InteractiveShell.instance()
    before = set(ip.user_ns)
    run(ip, "%load_ext nbguard")
    ip.user_ns["tok"] = byte_level_tokenizer()
    assert run(ip, SETUP).error is None
    yield ip
    run(ip, "%unload_ext nbguard")
    for name in set(ip.user_ns) - before:
        del ip.user_ns[name]


def _diagnoses(cell) -> list[dict]:
    return [d["diagnoses"][0] for d in cell.docs if d["kind"] == "diagnosis"]


def _prompt_is_a_prefix(tok, row) -> bool:
    prompt_ids = tok(row["prompt"])["input_ids"]
    return row["input_ids"][:len(prompt_ids)] == prompt_ids


def test_a_trailing_space_is_explained_and_the_written_fix_puts_the_whole_prompt_back(shell):
    shell.user_ns["rows"] = ROWS
    cell = run(shell, "trainer = sft(Dataset.from_list(rows))")
    assert cell.error is None, cell.stderr
    [diagnosis] = _diagnoses(cell)
    assert diagnosis["signature"] == "prompt-not-a-prefix"
    assert diagnosis["evidence"] == {"warning_origin": "trl.trainer.sft_trainer", "dropped_text": " ",
                                     "whitespace_only": True}
    tok, trained = shell.user_ns["tok"], shell.user_ns["trainer"].train_dataset
    assert not any(_prompt_is_a_prefix(tok, row) for row in trained)  # what it says: the prompt's end is not trained

    fix = re.search(r"dataset = dataset\.map\(.*?\}\)", diagnosis["detail"]).group(0)  # the fix as written
    cell = run(shell, f"dataset = Dataset.from_list(rows)\n{fix}\nfixed = sft(dataset)")
    assert cell.error is None, cell.stderr
    assert _diagnoses(cell) == []  # TRL no longer warns
    fixed = shell.user_ns["fixed"].train_dataset
    assert [row["prompt"] for row in fixed] == ["The capital of France is", "The capital of Italy is"]
    assert all(_prompt_is_a_prefix(tok, row) for row in fixed)
    assert [row["completion"] for row in fixed] == [" Paris.</s>", " Rome.</s>"]  # the space moved, TRL's EOS added
    for row in fixed:  # exactly the completion is supervised
        supervised = [i for i, label in zip(row["input_ids"], row["labels"]) if label != -100]
        assert tok.decode(supervised) == row["completion"]


def test_a_prompt_cut_inside_a_word_is_told_to_end_on_a_token_boundary(caplog):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from nbguard.testing import tiny_llama

    rows = [{"prompt": "The capital of Fra", "completion": "nce is Paris."}]
    with caplog.at_level(logging.WARNING, logger="trl"):
        SFTTrainer(model=tiny_llama(), processing_class=byte_level_tokenizer(), train_dataset=Dataset.from_list(rows),
                   args=SFTConfig(output_dir=tempfile.mkdtemp(prefix="nbguard-prefix-"), use_cpu=True, report_to=[]))
    [record] = [r for r in caplog.records if "not a prefix" in r.getMessage()]
    diagnosis = diagnose_warning(record.getMessage(), record.name)
    assert diagnosis is not None and diagnosis.signature == "prompt-not-a-prefix"
    assert diagnosis.evidence["whitespace_only"] is False and diagnosis.evidence["dropped_text"].strip() == "Fra"
    assert "end the prompt on a token boundary" in diagnosis.detail and "rstrip" not in diagnosis.detail


def _prompt_findings(trainer) -> list:
    return [f for f in nbguard.audit(trainer=trainer).findings if f.rule == "prompt-end-not-trained"]


def test_the_audit_counts_the_cut_rows_where_trl_no_longer_warns(caplog):
    """TRL warns once per process: the second trainer built on the same rows says nothing; the audit still sees it."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from nbguard.testing import tiny_llama

    tok = byte_level_tokenizer()

    def sft(rows):
        return SFTTrainer(model=tiny_llama(), processing_class=tok, train_dataset=Dataset.from_list(rows),
                          args=SFTConfig(output_dir=tempfile.mkdtemp(prefix="nbguard-prefix-"), use_cpu=True,
                                         report_to=[]))

    rows = ROWS + [{"prompt": "The capital of Spain is", "completion": " Madrid."}]  # this one ends on a boundary
    with caplog.at_level(logging.WARNING, logger="trl"):
        sft(rows)
        assert [r for r in caplog.records if "not a prefix" in r.getMessage()]  # the first one warns
        caplog.clear()
        again = sft(rows)
    assert not [r for r in caplog.records if "not a prefix" in r.getMessage()]  # TRL's warning_once: silent now
    [finding] = _prompt_findings(again)
    assert finding.severity.value == "warning"
    assert finding.title == "2 of 3 checked rows train without the end of their prompt (' ')"
    assert finding.evidence["rows_cut"] == {"first": [0, 1], "count": 2}
    assert finding.evidence["whitespace_only"] is True and "dataset.map(" in finding.detail
    assert _prompt_findings(sft([rows[2]])) == []  # the row that ends on a token boundary alone: nothing to say
    # truncated inside the prompt (TRL 1.16 then drops the row, fully masked; a pipeline that keeps it): no
    # completion is left to compare with, so nothing is claimed
    truncated = sft(rows)
    truncated.train_dataset = truncated.train_dataset.map(lambda row: {"input_ids": row["input_ids"][:3]})
    assert _prompt_findings(truncated) == []
    [word] = _prompt_findings(sft([{"prompt": "The capital of Fra", "completion": "nce is Paris."}]))
    assert word.evidence["whitespace_only"] is False and word.evidence["dropped_texts"]["first"] == [" Fra"]


def test_labels_masked_by_the_prompts_own_length_never_teach_the_completions_first_token(tmp_path):
    """The hand-written recipe (labels = -100 for len(tokenize(prompt)) tokens) on a plain Trainer: the merged
    " Paris" counts as prompt. The finding says so, and the fix it writes makes " Paris" supervised."""
    from datasets import Dataset
    from transformers import DataCollatorForSeq2Seq, Trainer, TrainingArguments

    from nbguard.testing import tiny_llama

    tok = byte_level_tokenizer()

    def tokenize(row):
        prompt_ids = tok(row["prompt"])["input_ids"]
        ids = tok(row["prompt"] + row["completion"])["input_ids"]
        return {"input_ids": ids, "labels": [-100] * len(prompt_ids) + ids[len(prompt_ids):]}

    def trainer(dataset):
        return Trainer(model=tiny_llama(vocab_size=len(tok)), train_dataset=dataset.map(tokenize),
                       data_collator=DataCollatorForSeq2Seq(tok), processing_class=tok,
                       args=TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[]))

    cut = trainer(Dataset.from_list(ROWS))
    row = cut.train_dataset[0]
    paris = row["input_ids"].index(tok.convert_tokens_to_ids("ĠParis"))
    assert row["labels"][paris] == -100  # what the finding will say: " Paris" is never supervised
    [finding] = _prompt_findings(cut)
    assert finding.title == "2 of 2 checked rows never supervise the start of their completion (' Paris')"
    assert finding.evidence["completion_start_masked"] == {"first": [" Paris", " Rome"], "count": 2}
    assert finding.evidence["dropped_texts"] == {"first": [" "], "count": 1}

    namespace = {"dataset": Dataset.from_list(ROWS)}
    exec(re.search(r"dataset = dataset\.map\(.*?\}\)", finding.detail).group(0), namespace)  # the fix as written
    fixed = trainer(namespace["dataset"])
    assert _prompt_findings(fixed) == []
    row = fixed.train_dataset[0]
    assert row["labels"][row["input_ids"].index(tok.convert_tokens_to_ids("ĠParis"))] != -100  # learned now

    # a prompt cut inside a word: the masked tokens are the merged word and what follows, no whitespace fix offered
    word = trainer(Dataset.from_list([{"prompt": "The capital of Fra", "completion": "nce is Paris."}]))
    row = word.train_dataset[0]
    assert tok.decode([i for i, label in zip(row["input_ids"], row["labels"]) if label == -100]) == \
        "The capital of France is"  # what the finding will say: " France is" is masked
    [finding] = _prompt_findings(word)
    assert finding.title == "1 of 1 checked rows never supervise the start of their completion (' France is')"
    assert "' Fra'" in finding.detail and "dataset.map(" not in finding.detail
