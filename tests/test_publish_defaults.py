"""Issue 40 finding 5 / item 4: nothing is published that the user did not ask for. A real Trainer run with
``report_to=["tensorboard"]`` and ``nbguard.watch(trainer)``: a NaN on the row that holds an e-mail address and
a phone number names that row (its excerpt stays in the local event), but the TensorBoard files get neither,
and no ``nbguard-report.html`` lands in ``output_dir`` (the folder ``push_to_hub`` uploads). ``log_rows=True``
and ``save_report=True`` turn each on."""
from __future__ import annotations

import pytest
import torch
from transformers import Trainer, TrainingArguments

import nbguard
from nbguard.testing import tiny_llama
from nbguard.trackers.trainer import REPORT_FILE

pytest.importorskip("tensorboard")
torch.set_num_threads(1)

EMAIL, PHONE = "alice.smith@example.com", "+1-202-555-0143"
EMAIL_ID, PHONE_ID, ROWS, POISONED = 100, 101, 8, 5


def _tokenizer():
    """A real word-level tokenizer whose words 100 and 101 are an e-mail address and a phone number."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 128)}}
    vocab = {word: i for word, i in vocab.items() if i not in (EMAIL_ID, PHONE_ID)}
    vocab.update({EMAIL: EMAIL_ID, PHONE: PHONE_ID})
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tok.pad_token = tok.eos_token
    return tok


class _Rows(torch.utils.data.Dataset):
    """Rows of words; row POISONED says "contact <email> or <phone>"."""

    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.rows = []
        for i in range(ROWS):
            ids = torch.randint(3, 100, (12,), generator=g)
            if i == POISONED:
                ids[4], ids[6] = EMAIL_ID, PHONE_ID
            self.rows.append({"input_ids": ids, "attention_mask": torch.ones(12, dtype=torch.long),
                              "labels": ids.clone()})

    def __len__(self):
        return ROWS

    def __getitem__(self, i):
        return self.rows[i]


def _run(tmp_path, monkeypatch, **watch_options):
    """A Trainer reporting to TensorBoard; the e-mail's embedding comes out NaN (a forward hook), so the
    step that trains on that row is non-finite and the row is named with its excerpt."""
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    model = tiny_llama()

    def poison(module, args, output):
        return output.masked_fill((args[0] == EMAIL_ID).unsqueeze(-1), float("nan"))

    model.model.embed_tokens.register_forward_hook(poison)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=ROWS // 2, per_device_train_batch_size=2,
                             use_cpu=True, report_to=["tensorboard"], save_strategy="no", logging_steps=1,
                             disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=_Rows(), processing_class=_tokenizer())
    watch = nbguard.watch(trainer, policy="skip", verify=False, **watch_options)
    trainer.train()
    watch.detach()
    [event] = [e for e in watch.events if e.kind == "nonfinite-loss"]
    assert POISONED in event.evidence["rows"]["dataset_indices"]
    [row] = [r for r in event.evidence["rows"]["rows"] if r["dataset_index"] == POISONED]
    assert EMAIL in row["excerpt"] and PHONE in row["excerpt"] and EMAIL in event.message  # local: all there
    return trainer, watch


def _tb_bytes(root) -> bytes:
    return b"".join(p.read_bytes() for p in (root / "tb").rglob("*") if p.is_file())


def test_by_default_row_text_stays_local_and_no_report_lands_in_output_dir(tmp_path, monkeypatch):
    _run(tmp_path, monkeypatch)
    data = _tb_bytes(tmp_path)
    assert b"nonfinite-loss" in data  # the event went to TensorBoard ...
    assert EMAIL.encode() not in data and PHONE.encode() not in data  # ... without the row's text
    assert b"dataset index 5" in data  # the row is still named, by index
    assert not (tmp_path / "out" / REPORT_FILE).exists()
    assert not [p for p in (tmp_path / "out").rglob("*") if "nbguard" in p.name]


def test_log_rows_and_save_report_publish_when_asked(tmp_path, monkeypatch):
    trainer, _ = _run(tmp_path, monkeypatch, log_rows=True, save_report=True)
    data = _tb_bytes(tmp_path)
    assert EMAIL.encode() in data and PHONE.encode() in data
    report = tmp_path / "out" / REPORT_FILE
    assert report.is_file() and EMAIL in report.read_text()


def test_save_report_takes_a_path_and_is_refused_where_nothing_would_write_it(tmp_path, monkeypatch):
    path = tmp_path / "elsewhere" / "run.html"
    _run(tmp_path, monkeypatch, save_report=path)
    assert path.is_file() and not (tmp_path / "out" / REPORT_FILE).exists()
    text = path.read_text()
    assert "dataset index 5" in text and EMAIL not in text  # a report file is the default's: rows left out
    with pytest.raises(ValueError, match="save_report"):
        nbguard.watch(tiny_llama(), optimizer=None, log_to=None, save_report=True)
    model = tiny_llama()
    with pytest.raises(ValueError, match="save_report is for a watched Trainer"):
        nbguard.watch(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), save_report=True)
    with pytest.raises(TypeError, match="log_rows"):
        nbguard.watch(tiny_llama(), log_rows="yes")
