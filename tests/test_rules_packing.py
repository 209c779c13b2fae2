"""Packed rows whose mask lets examples attend across their boundary: the packed loss differs from the unpacked."""
from __future__ import annotations

import pytest
import torch
from data_helpers import ListDataset, ragged_examples

import nbguard
from nbguard.testing import tiny_llama


class FlattenWithMask:
    """transformers' DataCollatorWithFlattening plus an all-ones attention_mask, as hand-written packing collators add."""

    def __init__(self):
        from transformers import DataCollatorWithFlattening

        self.flatten = DataCollatorWithFlattening()

    def __call__(self, features):
        batch = self.flatten(features)
        batch["attention_mask"] = torch.ones_like(batch["input_ids"])
        return batch


def packing_trainer(tmp_path, collator):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], save_strategy="no", max_steps=1,
                             per_device_train_batch_size=3, disable_tqdm=True)
    return Trainer(model=tiny_llama(), args=args, train_dataset=ListDataset(ragged_examples(6)), data_collator=collator)


def packed_rule(result):
    return [f for f in result.findings if f.rule == "packed-samples-attend-across"]


def unpacked_loss(model, batch) -> float:
    """The mean loss over the same labels, each example run on its own."""
    ids, labels, positions = batch["input_ids"][0], batch["labels"][0], batch["position_ids"][0]
    starts = (positions == 0).nonzero().flatten().tolist() + [len(ids)]
    total, count = 0.0, 0
    for a, b in zip(starts, starts[1:]):
        with torch.no_grad():
            logits = model(input_ids=ids[None, a:b]).logits[0, :-1]
        target = labels[a + 1:b]
        keep = target != -100
        total += float(torch.nn.functional.cross_entropy(logits[keep], target[keep], reduction="sum"))
        count += int(keep.sum())
    return total / count


def packed_loss(model, batch) -> float:
    with torch.no_grad():
        return float(model(**batch).loss)


def test_packed_batch_with_attention_mask_is_flagged_and_its_loss_differs(tmp_path):
    trainer = packing_trainer(tmp_path, FlattenWithMask())
    batch = next(iter(trainer.get_train_dataloader()))
    model = trainer.model.eval()
    assert packed_loss(model, batch) != pytest.approx(unpacked_loss(model, batch), rel=1e-3)  # samples mix
    trainer.model.train()
    (f,) = packed_rule(nbguard.audit(trainer=trainer))
    assert f.severity.value == "error" and f.evidence["attention_mask_in_batch"] is True
    assert f.evidence["cross_example_pairs"] > 0 and f.fixes == ["drop-mask-for-packing"]

    assert nbguard.fixes.apply("drop-mask-for-packing", trainer=trainer).changed
    fixed = next(iter(trainer.get_train_dataloader()))
    assert "attention_mask" not in fixed
    assert packed_loss(model, fixed) == pytest.approx(unpacked_loss(model, fixed), rel=1e-4)
    assert not packed_rule(nbguard.audit(trainer=trainer))
    assert not nbguard.fixes.apply("drop-mask-for-packing", trainer=trainer).changed  # never wrapped twice


def test_padding_free_batch_without_mask_stays_quiet(tmp_path):
    from transformers import DataCollatorWithFlattening

    trainer = packing_trainer(tmp_path, DataCollatorWithFlattening())
    batch = next(iter(trainer.get_train_dataloader()))
    assert packed_loss(trainer.model.eval(), batch) == pytest.approx(unpacked_loss(trainer.model, batch), rel=1e-4)
    assert not packed_rule(nbguard.audit(trainer=trainer))


def test_padded_unpacked_batch_stays_quiet(tmp_path):
    from data_helpers import word_tokenizer
    from transformers import DataCollatorForLanguageModeling

    tok = word_tokenizer(pad="unk")
    trainer = packing_trainer(tmp_path, DataCollatorForLanguageModeling(tok, mlm=False))
    assert not packed_rule(nbguard.audit(trainer=trainer))


def test_fix_cell_names_the_trainer():
    cell = nbguard.fixes.code("drop-mask-for-packing", trainer="sft")
    assert "sft.data_collator = DropMaskForPacking(sft.data_collator)" in cell
    compile(cell, "<cell>", "exec")
