"""Truncation and context (issue 34 item 2), on real trainers: TRL 1.16's SFTTrainer, whose prepared dataset is
truncated to SFTConfig.max_length, and a plain Trainer over rows tokenized with truncation=True, max_length=N.

answers-cut-by-max-length names exactly the rows whose answer the cap cut (dataset indices of
trainer.train_dataset) and their share; drop-truncated-rows, applied on the trainer as built (and its cell run as
written), leaves the re-audit quiet. max-length-beyond-positions flags rows past max_position_embeddings and is
quiet where a RoPE scaling covers them.
"""
from __future__ import annotations

import tempfile

import pytest
import torch
from data_helpers import EOS, ListDataset, lm_trainer, word_tokenizer

import nbguard
from nbguard.introspect.truncation import position_coverage
from nbguard.testing import tiny_llama

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

CUT = "answers-cut-by-max-length"
BEYOND = "max-length-beyond-positions"


def words(n: int, seed: int) -> str:
    return " ".join(f"w{3 + (seed * 7 + j * 3) % 120}" for j in range(n))


def texts(rows: int, long_rows: dict[int, int], seed: int = 0) -> list[str]:
    """``rows`` texts of 3-9 words; the rows in ``long_rows`` get that many words instead."""
    return [words(long_rows.get(i, 3 + (i * 5 + seed) % 7), i + seed) for i in range(rows)]


def sft(rows: list[str], max_length: int | None, model=None, tok=None, packing: bool = False):
    config = trl.SFTConfig(output_dir=tempfile.mkdtemp(), max_length=max_length, per_device_train_batch_size=4,
                           max_steps=1, use_cpu=True, bf16=False, report_to="none", save_strategy="no",
                           disable_tqdm=True, packing=packing)
    return trl.SFTTrainer(model=model if model is not None else tiny_llama(), args=config,
                          processing_class=tok or word_tokenizer(pad="unk"),
                          train_dataset=datasets.Dataset.from_list([{"text": t} for t in rows]))


def found(trainer, rule_id: str):
    return [f for f in nbguard.audit(trainer=trainer).findings if f.rule == rule_id]


# ---- answers-cut-by-max-length ---------------------------------------------------------------------------------
LONG = {3: 30, 17: 22, 29: 40}  # rows whose text (plus the EOS TRL appends) runs past max_length=16
EXACT = {11: 15}  # 15 words + EOS = 16 tokens: reaches the cap with its EOS, not cut


def test_sft_rows_cut_by_max_length_are_named_with_their_share():
    trainer = sft(texts(40, {**LONG, **EXACT}), max_length=16)
    lengths = [len(r) for r in trainer.train_dataset["input_ids"]]
    assert [i for i, n in enumerate(lengths) if n == 16] == [3, 11, 17, 29]  # TRL cut to 16; row 11 fits exactly
    [f] = found(trainer, CUT)
    assert f.evidence["rows"] == {"first": [3, 17, 29], "count": 3}
    assert f.evidence["share"] == pytest.approx(3 / 40) and f.evidence["supervised_rows"] == 40
    assert f.evidence["max_length"] == 16 and f.evidence["cap_source"] == "SFTConfig.max_length"
    assert f.severity == "warning" and "3 of 40 supervised rows (7.5%)" in f.title
    assert f.fixes == ["drop-truncated-rows"]


def test_a_share_under_one_percent_is_info():
    trainer = sft(texts(120, {50: 25}), max_length=16)
    [f] = found(trainer, CUT)
    assert f.severity == "info" and f.evidence["rows"]["first"] == [50]
    assert f.evidence["share"] == pytest.approx(1 / 120)


def test_sft_healthy_twin_with_room_for_every_answer_is_quiet():
    trainer = sft(texts(40, {**LONG, **EXACT}), max_length=64)
    assert max(len(r) for r in trainer.train_dataset["input_ids"]) == 41  # nothing cut: 40 words + EOS
    assert found(trainer, CUT) == []


def test_drop_truncated_rows_on_the_trainer_as_built_and_its_cell_as_written():
    trainer = sft(texts(40, {**LONG, **EXACT}), max_length=16)
    kept_by_apply = None
    applied = nbguard.fixes.apply("drop-truncated-rows", trainer=trainer)
    assert "40 -> 37 rows" in applied.changed["trainer.train_dataset"]
    kept_by_apply = trainer.train_dataset["input_ids"]
    assert all(len(r) < 16 or r[-1] == EOS for r in kept_by_apply) and len(kept_by_apply) == 37
    assert found(trainer, CUT) == []  # re-audit quiet
    batch = next(iter(trainer.get_train_dataloader()))  # the trainer still trains on what is left
    assert batch["input_ids"].shape[0] == 4
    assert not nbguard.fixes.apply("drop-truncated-rows", trainer=trainer).changed  # idempotent

    fresh = sft(texts(40, {**LONG, **EXACT}), max_length=16)
    exec(nbguard.fixes.code("drop-truncated-rows", trainer="trainer"), {"trainer": fresh})
    assert fresh.train_dataset["input_ids"] == kept_by_apply
    assert found(fresh, CUT) == []


def test_packed_sft_rows_are_not_read_as_examples():
    trainer = sft(texts(40, LONG), max_length=16, packing=True)
    assert found(trainer, CUT) == []  # packs end where the packer stopped, not where an answer was cut


def plain_trainer(max_length: int, long_rows: dict[int, int], rows: int = 24):
    """A plain Trainer over rows tokenized as a notebook does: text + EOS, truncation=True, max_length=N."""
    from transformers import TrainingArguments

    tok = word_tokenizer(pad="unk")
    encoded = [tok(t + " </s>", truncation=True, max_length=max_length) for t in texts(rows, long_rows, seed=1)]
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4, max_steps=1,
                             use_cpu=True, report_to="none", save_strategy="no", disable_tqdm=True)
    return lm_trainer(tiny_llama(), args, [{"input_ids": e["input_ids"]} for e in encoded], tokenizer=tok)


def test_plain_trainer_rows_cut_by_the_tokenizer_are_named_from_the_inferred_cap():
    trainer = plain_trainer(12, {2: 20, 9: 14, 20: 30})
    [f] = found(trainer, CUT)
    assert f.evidence["rows"]["first"] == [2, 9, 20] and f.evidence["cap_source"] == "inferred"
    assert f.evidence["max_length"] == 12 and f.evidence["share"] == pytest.approx(3 / 24)
    applied = nbguard.fixes.apply("drop-truncated-rows", trainer=trainer)
    assert isinstance(trainer.train_dataset, torch.utils.data.Subset) and len(trainer.train_dataset) == 21, applied
    assert found(trainer, CUT) == []


def test_plain_trainer_healthy_twin_is_quiet():
    assert found(plain_trainer(64, {2: 20, 9: 14, 20: 30}), CUT) == []


def test_fixed_length_rows_without_eos_anywhere_are_not_called_cut():
    """Rows all of one length and none ending with EOS (random-token pre-training chunks): no cap is evident."""
    from transformers import TrainingArguments

    rows = [{"input_ids": list(range(3 + i % 5, 19 + i % 5))} for i in range(12)]
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4, use_cpu=True,
                             report_to="none", disable_tqdm=True)
    trainer = lm_trainer(tiny_llama(), args, rows, tokenizer=word_tokenizer(pad="unk"))
    assert isinstance(trainer.train_dataset, ListDataset) and found(trainer, CUT) == []


# ---- max-length-beyond-positions -------------------------------------------------------------------------------
def long_rows() -> list[str]:
    return texts(12, {i: 45 + i for i in range(0, 12, 3)})  # rows of up to 55 tokens


def test_rows_past_max_position_embeddings_are_flagged():
    trainer = sft(long_rows(), max_length=64, model=tiny_llama(max_position_embeddings=32))
    [f] = found(trainer, BEYOND)
    assert f.severity == "warning" and f.evidence["training_length"] == 55
    assert f.evidence["covered_length"] == 32 and f.evidence["rope_type"] == "default"
    assert "'factor': 2.0" in f.detail and "original_max_position_embeddings': 32" in f.detail


def test_a_rope_scaling_that_covers_the_rows_is_quiet_and_one_that_falls_short_is_not():
    yarn = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32}
    assert found(sft(long_rows(), 64, model=tiny_llama(max_position_embeddings=32, rope_scaling=yarn)), BEYOND) == []
    linear = {"rope_type": "linear", "factor": 1.5}
    [f] = found(sft(long_rows(), 64, model=tiny_llama(max_position_embeddings=32, rope_scaling=linear)), BEYOND)
    assert f.evidence["covered_length"] == 48 and f.evidence["rope_type"] == "linear"
    assert "Raise the factor to 2.0" in f.detail


def test_healthy_positions_are_quiet():
    assert found(sft(long_rows(), 64, model=tiny_llama(max_position_embeddings=64)), BEYOND) == []


def test_learned_absolute_positions_are_an_error():
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=1, n_head=2))
    tok = word_tokenizer(pad="unk")
    rows = [{"input_ids": tok(t + " </s>")["input_ids"]} for t in long_rows()]
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4, use_cpu=True,
                             report_to="none", disable_tqdm=True)
    [f] = found(lm_trainer(model, args, rows, tokenizer=tok), BEYOND)
    assert f.severity == "error" and f.evidence["position_table"] == "transformer.wpe"
    with pytest.raises(IndexError):  # what the finding predicts, on the model itself
        model(input_ids=torch.tensor([rows[0]["input_ids"]]))


@pytest.mark.parametrize(("params", "mpe", "covered"), [
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, 32768, 131072),  # Qwen3
    ({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192, "low_freq_factor": 1.0,
      "high_freq_factor": 4.0}, 131072, 131072),  # Llama 3.1 lists the stretched length itself
    ({"rope_type": "dynamic", "factor": 2.0}, 4096, 8192),
    ({"rope_type": "default"}, 4096, 4096),
])
def test_coverage_of_published_rope_configs(params, mpe, covered):
    from transformers import LlamaConfig

    cfg = LlamaConfig(max_position_embeddings=mpe, rope_scaling={**params, "rope_theta": 10000.0})
    assert position_coverage(cfg).covered == covered


def test_the_position_probe_reports_the_loss_before_and_past_the_covered_length():
    """audit(probe=True): one forward of the longest row; its numbers are the model's own per-position loss. The
    tiny model is random-init, so the two means carry no position signal here: only the measurement is checked."""
    model = tiny_llama(max_position_embeddings=32)
    trainer = sft(long_rows(), max_length=64, model=model)
    assert "position_loss" not in found(trainer, BEYOND)[0].evidence  # only when the probe is asked for
    [f] = [f for f in nbguard.audit(trainer=trainer, probe=True).findings if f.rule == BEYOND]
    probe = f.evidence["position_loss"]
    row = trainer.train_dataset[probe["dataset_row"]]["input_ids"]
    assert len(row) == probe["tokens"] == 55 and (probe["positions_within"], probe["positions_beyond"]) == (32, 22)
    was_training = model.training
    with torch.no_grad():
        model.train()  # as the probe runs it (no dropout in this model: the loss is deterministic)
        logits = model(input_ids=torch.tensor([row])).logits[0]
        model.train(was_training)
    loss = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(row[1:]), reduction="none")
    assert probe["mean_loss_within"] == pytest.approx(loss[:32].mean().item(), rel=1e-4)
    assert probe["mean_loss_beyond"] == pytest.approx(loss[32:].mean().item(), rel=1e-4)
    assert f"{probe['mean_loss_beyond']:.3f} over the 22 positions past it" in f.detail
