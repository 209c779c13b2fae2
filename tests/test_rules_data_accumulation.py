"""Item 4 of issue 13: gradient accumulation with a loss that ignores ``num_items_in_batch``.

The mechanism is proved on real Trainer runs: the same 8 examples in one optimizer step, once as one batch of
8 and once as 4 accumulated micro-batches of 2. The logged loss of the second run is 4x the first when the loss
ignores the count, and equal again after the fix."""
from __future__ import annotations

import pytest
import torch
from audit_helpers import make_args
from transformers import Trainer

import nbguard
import nbguard.fixes as fixes
from nbguard.auditor.rules.accumulation import passes_num_items
from nbguard.testing import TinyDataset, tiny_llama

GA = 4


class MeanLossTrainer(Trainer):
    """A common override: calls the model without num_items_in_batch, so each micro-batch loss is a mean."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], labels=inputs["labels"])
        return (outputs.loss, outputs) if return_outputs else outputs.loss


class SummedLossTrainer(Trainer):
    """The same override done right: sum the token losses and divide by the step's count."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**inputs, num_items_in_batch=num_items_in_batch)
        return (outputs.loss, outputs) if return_outputs else outputs.loss


class OldSignatureTrainer(Trainer):
    """An override written before transformers 4.46: no num_items_in_batch parameter at all."""

    def compute_loss(self, model, inputs, return_outputs=False):
        outputs = model(**inputs)
        return (outputs.loss, outputs) if return_outputs else outputs.loss


class KwargsIgnoringLM(torch.nn.Module):
    """A custom model whose forward takes **kwargs (so the Trainer passes num_items_in_batch) and drops them."""

    def __init__(self):
        super().__init__()
        self.lm = tiny_llama()

    def forward(self, input_ids, attention_mask=None, labels=None, **kwargs):
        return self.lm(input_ids=input_ids, attention_mask=attention_mask, labels=labels)


def build(tmp_path, name, trainer_class=Trainer, model=None, accumulate=True, **overrides):
    batch = dict(per_device_train_batch_size=2, gradient_accumulation_steps=GA) if accumulate else dict(
        per_device_train_batch_size=2 * GA, gradient_accumulation_steps=1)
    args = make_args(tmp_path / name, max_steps=1, seed=0, **batch, **overrides)
    return trainer_class(model=model if model is not None else tiny_llama(), args=args,
                         train_dataset=TinyDataset(2 * GA, 16))


def logged_loss(trainer) -> float:
    trainer.train()
    return next(e["loss"] for e in trainer.state.log_history if "loss" in e)


def audit(**kw):
    return nbguard.audit(hardware="a100", **kw)


def test_an_override_that_ignores_the_count_logs_ga_times_the_loss_and_the_fix_restores_it(tmp_path):
    reference = logged_loss(build(tmp_path, "ref", MeanLossTrainer, accumulate=False))
    broken = build(tmp_path, "broken", MeanLossTrainer)
    f = audit(trainer=broken).finding("accumulation-loss-scale")
    assert f is not None and f.fixes == ["scale-loss-for-accumulation"] and f.severity == "warning"
    assert f.evidence["normaliser"] == "compute_loss" and f.evidence["reads_num_items_in_batch"] is False
    assert "MeanLossTrainer.compute_loss" in f.evidence["function"] and f"{GA}x" in f.title
    assert logged_loss(broken) / reference == pytest.approx(GA, rel=1e-3)  # the mechanism, on a real run

    fixed = build(tmp_path, "fixed", MeanLossTrainer)
    first = fixes.apply("scale-loss-for-accumulation", trainer=fixed)
    # transformers >= 5.19 reads loss_is_scaled_for_ga; older releases divide when the model takes no loss kwargs
    flag = "loss_is_scaled_for_ga" if hasattr(Trainer, "loss_is_scaled_for_ga") else "model_accepts_loss_kwargs"
    assert first.changed == {f"trainer.{flag}": f"{'None' if flag == 'loss_is_scaled_for_ga' else 'True'} -> False"}
    assert fixes.apply("scale-loss-for-accumulation", trainer=fixed).changed == {}
    assert "accumulation-loss-scale" not in audit(trainer=fixed)
    assert logged_loss(fixed) / reference == pytest.approx(1.0, rel=1e-3)

    cell_fixed = build(tmp_path, "cell", MeanLossTrainer)
    cell = fixes.code("scale-loss-for-accumulation", trainer="my_trainer")
    assert "my_trainer.loss_is_scaled_for_ga = False" in cell and "nbguard" not in cell
    exec(compile(cell, "<nbguard fix cell>", "exec"), {"my_trainer": cell_fixed})
    assert logged_loss(cell_fixed) / reference == pytest.approx(1.0, rel=1e-3)


def test_transformers_models_and_correct_overrides_are_not_flagged(tmp_path):
    plain = build(tmp_path, "plain")
    assert plain.model_accepts_loss_kwargs  # the count goes to LlamaForCausalLM, which divides by it
    assert "accumulation-loss-scale" not in audit(trainer=plain)
    reference = logged_loss(build(tmp_path, "plain-ref", accumulate=False))
    assert logged_loss(plain) / reference == pytest.approx(1.0, rel=1e-3)
    assert "accumulation-loss-scale" not in audit(trainer=build(tmp_path, "summed", SummedLossTrainer))
    assert "accumulation-loss-scale" not in audit(trainer=build(tmp_path, "noga", MeanLossTrainer, accumulate=False))
    explicit = build(tmp_path, "explicit", MeanLossTrainer)
    # the user told the Trainer to divide by the accumulation steps (the switch older releases read instead)
    setattr(explicit, "loss_is_scaled_for_ga" if hasattr(Trainer, "loss_is_scaled_for_ga") else
            "model_accepts_loss_kwargs", False)
    assert "accumulation-loss-scale" not in audit(trainer=explicit)


def test_a_custom_forward_that_drops_kwargs_is_flagged(tmp_path):
    reference = logged_loss(build(tmp_path, "ref", model=KwargsIgnoringLM(), accumulate=False))
    trainer = build(tmp_path, "custom", model=KwargsIgnoringLM())
    f = audit(trainer=trainer).finding("accumulation-loss-scale")
    assert f.evidence["normaliser"] == "model.forward" and "KwargsIgnoringLM.forward" in f.evidence["function"]
    assert logged_loss(trainer) / reference == pytest.approx(GA, rel=1e-3)


class DeclaredScaleTrainer(MeanLossTrainer):
    """A trainer class that declares its own scaling, as TRL's GRPO/RLOO/KTO trainers do."""

    loss_is_scaled_for_ga = True


def test_declared_scaling_and_unlabelled_batches_are_trusted(tmp_path):
    flagged = "accumulation-loss-scale" in audit(trainer=build(tmp_path, "declared", DeclaredScaleTrainer))
    # Releases before 5.19 ignore the declaration (the loss really is 4x there): flagged exactly then
    assert flagged is not hasattr(Trainer, "loss_is_scaled_for_ga")
    trainer = build(tmp_path, "nolabels", MeanLossTrainer)
    trainer.train_dataset.rows = [{k: v for k, v in r.items() if k != "labels"} for r in trainer.train_dataset.rows]
    assert "accumulation-loss-scale" not in audit(trainer=trainer)  # no labels: the Trainer counts nothing


def test_an_old_signature_is_an_error_and_train_really_raises(tmp_path):
    trainer = build(tmp_path, "old", OldSignatureTrainer, accumulate=False)  # raises with or without accumulation
    f = audit(trainer=trainer).finding("accumulation-loss-scale")
    assert f.severity == "error" and f.evidence["accepts_num_items_in_batch"] is False
    with pytest.raises(TypeError, match="num_items_in_batch"):
        trainer.train()


def test_bytecode_reading_of_num_items_in_batch():
    def reads(model, inputs, num_items_in_batch=None):
        return model(inputs) / num_items_in_batch

    def forwards(model, inputs, **kwargs):
        return model(inputs, **kwargs)

    def ignores(model, inputs, num_items_in_batch=None, **kwargs):
        return model(inputs)

    def nested(model, inputs, num_items_in_batch=None):
        return [model(x) / num_items_in_batch for x in inputs]

    assert passes_num_items(reads) and passes_num_items(forwards) and passes_num_items(nested)
    assert passes_num_items(ignores) is False
    assert passes_num_items(len) is None  # a builtin has no bytecode: unknown, never flagged
