"""Data and config fixes proven on the trainer as built: its collator, its processing class, TRL's prepared rows.

TRL 1.16's RewardTrainer pads with EOS when the tokenizer has no pad token, and its collator
(DataCollatorForPreference) keeps the pad id it was given at construction. A fix that only changes the
tokenizer and the config leaves the collator padding with EOS: the head then pools a padding EOS.
"""
from __future__ import annotations

import pytest
import torch
from data_helpers import EOS, word_tokenizer

import nbguard

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

POOLS = "classifier-pools-wrong-token"


def classifier():
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from nbguard.testing import TINY_VOCAB

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=TINY_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, num_labels=1)
    return LlamaForSequenceClassification(cfg)


def reward_trainer(tmp_path):
    """TRL's RewardTrainer as a user builds it: a tokenizer without a pad token (TRL pads with EOS)."""
    rows = [{"chosen": " ".join(f"w{3 + (i * 5 + j) % 90}" for j in range(3 + i % 4)),
             "rejected": " ".join(f"w{3 + (i * 7 + j) % 90}" for j in range(2 + i % 3))} for i in range(8)]
    config = trl.RewardConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=1, use_cpu=True,
                              report_to="none", save_strategy="no", disable_tqdm=True)
    tok = word_tokenizer(pad=None)
    return trl.RewardTrainer(model=classifier(), args=config, processing_class=tok,
                             train_dataset=datasets.Dataset.from_list(rows)), tok


def padded_with(trainer) -> set[int]:
    """The ids the trainer's own dataloader pads its batches with (positions the mask leaves out)."""
    batch = next(iter(trainer.get_train_dataloader()))
    return set(batch["input_ids"][batch["attention_mask"] == 0].tolist())


def test_distinct_pad_reaches_the_reward_trainers_collator_and_the_reaudit_is_quiet(tmp_path):
    trainer, tok = reward_trainer(tmp_path)
    assert padded_with(trainer) == {EOS}  # TRL fell back to EOS
    [f] = [f for f in nbguard.audit(trainer=trainer).findings if f.rule == POOLS]
    assert f.fixes == ["distinct-pad-token"]
    applied = nbguard.fixes.apply("distinct-pad-token", trainer=trainer)
    assert applied.changed["trainer.data_collator.pad_token_id"] == f"{EOS} -> {tok.pad_token_id}"
    # the trainer as built now pads with the new token, and its own batches are scored at their last token
    assert padded_with(trainer) == {tok.pad_token_id} and tok.pad_token_id != EOS
    assert [f for f in nbguard.audit(trainer=trainer).findings if f.rule == POOLS] == []
    assert trainer.model.config.pad_token_id == tok.pad_token_id


def test_the_distinct_pad_cell_run_as_written_fixes_the_trainer_as_built(tmp_path):
    trainer, tok = reward_trainer(tmp_path)
    code = nbguard.fixes.code("distinct-pad-token", trainer="trainer", tokenizer="tokenizer", model="trainer.model")
    assert "data_collator" in code and "reward" in code  # it says what a reward head scores, and reaches the collator
    exec(compile(code, "<fix cell>", "exec"), {"trainer": trainer, "tokenizer": tok})
    assert padded_with(trainer) == {tok.pad_token_id} != {EOS}
    assert [f for f in nbguard.audit(trainer=trainer).findings if f.rule == POOLS] == []


def test_the_finding_names_the_id_the_batches_are_padded_with(tmp_path):
    """After a fix that reached the tokenizer and the config only, the batches still pad with EOS: the finding
    says so from the batches, not from the tokenizer, and does not offer the sync fix that already holds."""
    trainer, tok = reward_trainer(tmp_path)
    tok.pad_token = tok.unk_token  # the tokenizer and the config changed, the collator not
    trainer.model.config.pad_token_id = tok.pad_token_id
    [f] = [f for f in nbguard.audit(trainer=trainer).findings if f.rule == POOLS]
    assert f.evidence["batches_padded_with"] == [EOS]
    assert f"the batches are padded with id {EOS}" in f.detail
    assert f.fixes == ["distinct-pad-token"]  # it rebuilds what pads: the collator (sync-pad-token-id holds already)
    applied = nbguard.fixes.apply("distinct-pad-token", trainer=trainer)
    assert applied.changed == {"trainer.data_collator.pad_token_id": f"{EOS} -> {tok.pad_token_id}"}
    assert [f for f in nbguard.audit(trainer=trainer).findings if f.rule == POOLS] == []
