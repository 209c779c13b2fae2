"""VLM batches: image placeholders cut by truncation, labels on placeholders or negative: a tiny Qwen2-VL."""
from __future__ import annotations

import pytest
import torch
from audit_helpers import make_args
from vlm_helpers import IMAGE, VLMExamples, collate, tiny_qwen2_vl

import nbguard
from nbguard.explainer import diagnose


def vlm_trainer(tmp_path, dataset, collator=collate):
    from transformers import Trainer

    return Trainer(model=tiny_qwen2_vl(), args=make_args(tmp_path, per_device_train_batch_size=2,
                                                         remove_unused_columns=False),
                   train_dataset=dataset, data_collator=collator)


def findings(trainer, rule_id):
    return [f for f in nbguard.audit(trainer=trainer).findings if f.rule == rule_id]


def test_truncation_inside_the_image_is_flagged_and_the_step_fails(tmp_path):
    trainer = vlm_trainer(tmp_path, VLMExamples(max_length=5))  # 2 of the 4 placeholders survive
    (f,) = findings(trainer, "vlm-image-tokens-truncated")
    assert f.evidence["batches"]["first"][0] == {"batch": 0, "image_tokens": 4, "image_features": 8}
    with pytest.raises(ValueError) as raised:
        trainer.train()
    assert diagnose(raised.value).signature == "vlm-image-tokens-mismatch"


def test_whole_images_stay_quiet_and_train(tmp_path):
    trainer = vlm_trainer(tmp_path, VLMExamples())
    result = nbguard.audit(trainer=trainer)
    assert not [f for f in result.findings if f.rule.startswith("vlm-") or f.rule == "forward-returns-no-loss"]
    trainer.train()


def test_labels_on_placeholders_are_flagged_and_masked_by_the_fix(tmp_path):
    def unmasked(ids, mask):  # labels = input_ids: the placeholders are targets
        return ids.masked_fill(mask == 0, -100)

    trainer = vlm_trainer(tmp_path, VLMExamples(), lambda f: collate(f, unmasked))
    batch = next(iter(trainer.get_train_dataloader()))
    assert int((batch["labels"] == IMAGE).sum()) == 8
    (f,) = findings(trainer, "vlm-labels-bad-ids")
    assert f.severity.value == "warning" and f.evidence["image_token_labels"] > 0
    assert nbguard.fixes.apply("mask-special-labels", trainer=trainer).changed
    assert not findings(trainer, "vlm-labels-bad-ids")


def test_negative_labels_other_than_ignore_index_fail_the_step(tmp_path):
    def minus_one(ids, mask):  # a collator that pads labels with -1 (and masks placeholders properly)
        return ids.masked_fill((mask == 0) | (ids == IMAGE), -1)

    trainer = vlm_trainer(tmp_path, VLMExamples(), lambda f: collate(f, minus_one))
    (f,) = findings(trainer, "vlm-labels-bad-ids")
    assert f.severity.value == "error" and f.evidence["negative_ids"] == [-1]
    with pytest.raises((IndexError, RuntimeError)):
        trainer.train()


def test_missing_mm_token_type_ids_is_a_failed_dry_forward(tmp_path):
    def without_types(features):
        batch = collate(features)
        batch.pop("mm_token_type_ids")
        return batch

    trainer = vlm_trainer(tmp_path, VLMExamples(), without_types)
    (f,) = findings(trainer, "forward-returns-no-loss")
    assert "mm_token_type_ids" in f.evidence["exception"]
    with pytest.raises(ValueError) as raised:
        trainer.train()
    diagnosis = diagnose(raised.value)
    assert diagnosis.signature == "model-returned-no-loss" and diagnosis.evidence["missing_input"] == "mm_token_type_ids"
