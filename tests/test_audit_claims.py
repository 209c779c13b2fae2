"""Claims checked against the run: each audit claim is compared with what a real Trainer step does.

Differential tests: the setup a rule flags as an error really fails in a real Trainer run on a tiny model,
and the neighbouring setup it passes (or only warns about) trains with a finite loss.
"""
from __future__ import annotations

import math

import pytest
import torch
from audit_helpers import make_args
from data_helpers import BOS, EOS, ListDataset, word_tokenizer
from transformers import DataCollatorForLanguageModeling, Trainer, TrainerCallback

import nbguard
from nbguard.findings import Severity
from nbguard.testing import plant_fp16_overflow_token, tiny_batch, tiny_gemma3, tiny_llama


class _Losses(TrainerCallback):
    def __init__(self):
        self.losses: list[float] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))


def _wikitext_rows(rows: int, empty_every: int) -> list[dict]:
    """Wikitext-style lines: every ``empty_every``-th one is an empty line (just BOS: nothing to predict)."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for i in range(rows):
        if i % empty_every == 0:
            out.append({"input_ids": [BOS]})
        else:
            out.append({"input_ids": [BOS, *torch.randint(3, 100, (6,), generator=gen).tolist(), EOS]})
    return out


def _lm_trainer(tmp_path, rows, **args):
    args = make_args(tmp_path, per_device_train_batch_size=1, logging_steps=1, logging_nan_inf_filter=False,
                     max_steps=len(rows) // args.get("gradient_accumulation_steps", 1), **args)
    collator = DataCollatorForLanguageModeling(word_tokenizer(), mlm=False)
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=ListDataset(rows), data_collator=collator)
    losses = _Losses()
    trainer.add_callback(losses)
    return trainer, losses


# ---- no-supervised-tokens: an error only where the step's loss can be 0/0 ----------------------------
def test_empty_batches_without_accumulation_are_an_error_and_the_run_gives_nan(tmp_path):
    trainer, losses = _lm_trainer(tmp_path, _wikitext_rows(16, 2))
    f = nbguard.audit(trainer).finding("no-supervised-tokens")
    trainer.train()
    if hasattr(trainer, "_loss_shifts_labels"):  # the divisor counts shifted labels: a BOS-only row is 0/0
        assert f.severity == Severity.ERROR and f.evidence["loss_can_be_nan"] is True
        assert "0/0 = NaN" in f.detail
        assert any(math.isnan(x) for x in losses.losses)  # the claim holds: some step's loss is 0/0
    else:  # transformers <= 5.9 counts the BOS label too: divisor 1, loss exactly 0, never NaN
        assert f.severity == Severity.WARNING and f.evidence["loss_can_be_nan"] is False
        assert "loss is exactly 0" in f.detail
        assert 0.0 in losses.losses and all(math.isfinite(x) for x in losses.losses)


def test_empty_micro_batches_inside_accumulation_contribute_nothing(tmp_path):
    """The DoRA example's case: accumulation 16, empty wikitext lines, loss normalised by num_items_in_batch."""
    trainer, losses = _lm_trainer(tmp_path, _wikitext_rows(32, 4), gradient_accumulation_steps=16)
    assert trainer.model_accepts_loss_kwargs  # the Trainer passes num_items_in_batch to this model
    f = nbguard.audit(trainer).finding("no-supervised-tokens")
    assert f.severity == Severity.WARNING and f.evidence["loss_can_be_nan"] is False
    assert f.evidence["gradient_accumulation_steps"] == 16 and f.evidence["empty_batches"]
    assert "contributes nothing" in f.detail and "0/0 = NaN with" not in f.detail
    trainer.train()
    assert len(losses.losses) == 2 and all(math.isfinite(x) for x in losses.losses)


# ---- fp16 on the CPU: the flag has no effect --------------------------------------------------------
def test_fp16_on_cpu_is_reported_as_no_effect_and_the_run_is_fp32(tmp_path):
    args = make_args(tmp_path, fp16=True, use_cpu=True)
    trainer = Trainer(model=tiny_gemma3(), args=args, train_dataset=ListDataset(_wikitext_rows(8, 100)),
                      data_collator=DataCollatorForLanguageModeling(word_tokenizer(), mlm=False))
    # What accelerate really does with it: no fp16 autocast, no GradScaler.
    assert trainer.accelerator.native_amp is False and trainer.accelerator.scaler is None
    here = nbguard.audit(trainer, hardware="cpu")
    ignored = here.finding("precision-flag-ignored")
    assert ignored is not None and "no effect" in ignored.title and ignored.evidence["effective"] == "fp32"
    assert here.finding("fp16-overflow-risk") is None  # a fp32 run has nothing to overflow
    assert here.finding("no-grad-clipping") is None
    # The risk is stated for the GPU the user names.
    on_t4 = nbguard.audit(trainer, hardware="t4")
    assert on_t4.finding("precision-flag-ignored") is None
    assert on_t4.finding("fp16-overflow-risk").severity == Severity.ERROR


def test_bf16_on_cpu_is_not_called_ignored(tmp_path):
    trainer = Trainer(model=tiny_llama(), args=make_args(tmp_path, bf16=True, use_cpu=True),
                      train_dataset=ListDataset(_wikitext_rows(8, 100)),
                      data_collator=DataCollatorForLanguageModeling(word_tokenizer(), mlm=False))
    assert trainer.accelerator.native_amp is True  # CPU autocast to bfloat16 is real
    assert nbguard.audit(trainer, hardware="cpu").finding("precision-flag-ignored") is None


# ---- probe texts count what they saw ---------------------------------------------------------------
HOT = 5  # the token planted to overflow q_proj


def _hot_batch():
    batch = tiny_batch(1, 12)
    batch["input_ids"][0, 3] = HOT
    return batch


def test_probe_text_says_over_the_limit_not_near_it(tmp_path):
    model = tiny_llama()
    plant_fp16_overflow_token(model, HOT)
    f = nbguard.audit(model, args=make_args(tmp_path, fp16=True), batch=_hot_batch(), hardware="t4",
                      probe=True).finding("fp16-overflow-risk")
    assert f.severity == Severity.ERROR
    assert "past 65504" in f.detail and "1.5x the limit" in f.detail
    assert "probe=True" not in f.detail  # the probe already ran


def test_probe_text_counts_nan_gradients_apart_from_near_limit_ones(tmp_path):
    model = tiny_llama(dtype=torch.float16)
    plant_fp16_overflow_token(model, HOT)
    result = nbguard.audit(model, args=make_args(tmp_path, fp16=True), batch=_hot_batch(), hardware="t4", probe=True)
    f = result.finding("fp16-overflow-risk")
    backward = result.probe.backward_near_limit()
    nan_grads = [m for m in backward if not math.isfinite(m["grad_absmax"])]
    assert nan_grads and len(nan_grads) == len(backward)  # the forward overflowed: every gradient is NaN
    assert f"In backward {len(nan_grads)} modules received inf/NaN gradients" in f.detail
    assert "at least half of 65504 before any loss scaling" not in f.detail
    # The probe section counts them the same way.
    from nbguard.document.view import view

    facts = [fact.text for s in view(result.to_dict()).sections if s.kind == "probe" for fact in s.facts]
    assert any(f"{len(nan_grads)} with inf/NaN gradients" in text for text in facts)


# ---- memory line counts what it says -----------------------------------------------------------------
def test_memory_line_counts_weights_gradients_and_optimizer_without_the_hidden_reserve():
    from nbguard.document.view import view

    model = tiny_llama()
    params = sum(p.numel() for p in model.parameters())
    result = nbguard.audit(model, hardware="t4")
    facts = [fact.text for s in view(result.to_dict()).sections if s.kind == "stack" for fact in s.facts]
    line = next(text for text in facts if text.startswith("training memory"))
    # fp32 AdamW: 4 (weight) + 4 (gradient) + 8 (two moments) bytes per parameter.
    expected = f"{params * 16 / 2 ** 20:.3g} MB"
    assert f"as stored {expected}" in line and "plus 1 GB kept for the CUDA context" in line


def test_audit_takes_a_trainer_positionally(tmp_path):
    trainer, _ = _lm_trainer(tmp_path, _wikitext_rows(4, 100))
    assert nbguard.audit(trainer).target == "trainer"


# ---- token-ids-out-of-range: an error when a batch really holds such an id ----------------------------
def _token_trainer(tmp_path, vocab: int, top: int):
    """Rows of ids below ``top`` for a model with ``vocab`` embedding rows (the tokenizer has 128 tokens)."""
    rows = [{"input_ids": [BOS, *range(top - 6, top), EOS]} for _ in range(4)]
    collator = DataCollatorForLanguageModeling(word_tokenizer(), mlm=False)
    trainer = Trainer(model=tiny_llama(vocab_size=vocab), args=make_args(tmp_path, per_device_train_batch_size=2),
                      train_dataset=ListDataset(rows), data_collator=collator, processing_class=word_tokenizer())
    return trainer


def test_token_ids_beyond_the_embedding_are_an_error_and_the_step_raises(tmp_path):
    trainer = _token_trainer(tmp_path, vocab=100, top=120)
    f = nbguard.audit(trainer).finding("token-ids-out-of-range")
    assert f.severity == Severity.ERROR and min(f.evidence["input_ids_out_of_range"]["first"]) >= 100
    with pytest.raises(IndexError, match="index out of range"):
        trainer.train()


def test_a_bigger_tokenizer_whose_ids_never_come_is_a_warning_and_trains(tmp_path):
    trainer = _token_trainer(tmp_path, vocab=100, top=90)
    f = nbguard.audit(trainer).finding("token-ids-out-of-range")
    assert f.severity == Severity.WARNING and "none of the" in f.detail and "holds such an id yet" in f.detail
    trainer.train()  # the claim holds: no id reaches the missing rows, the run trains
    assert "token-ids-out-of-range" not in nbguard.audit(_token_trainer(tmp_path, vocab=128, top=120))


def test_fp16_weights_under_fp16_on_the_cpu_are_no_unscale_error_and_train(tmp_path):
    """fp16-unscale-error's failing setup needs a GradScaler; on the CPU the Trainer makes none."""
    model = tiny_llama(dtype=torch.float16)
    trainer = Trainer(model=model, args=make_args(tmp_path, fp16=True, max_steps=1),
                      train_dataset=ListDataset(_wikitext_rows(4, 100)),
                      data_collator=DataCollatorForLanguageModeling(word_tokenizer(), mlm=False))
    result = nbguard.audit(trainer, hardware="cpu")
    assert "fp16-unscale-error" not in result and "precision-flag-ignored" in result
    trainer.train()  # no "Attempting to unscale FP16 gradients": there is no scaler
    assert nbguard.audit(trainer, hardware="t4").finding("fp16-unscale-error").severity == Severity.ERROR


def test_a_users_own_compute_loss_is_read_as_a_per_batch_mean(tmp_path):
    class MeanLossTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            outputs = model(**inputs)  # the model's own mean: num_items_in_batch is not passed on
            return (outputs.loss, outputs) if return_outputs else outputs.loss

    trainer, losses = _lm_trainer(tmp_path, _wikitext_rows(32, 4), gradient_accumulation_steps=16)
    mean = MeanLossTrainer(model=trainer.model, args=trainer.args, train_dataset=trainer.train_dataset,
                           data_collator=trainer.data_collator, callbacks=[losses])
    f = nbguard.audit(mean).finding("no-supervised-tokens")
    assert f.severity == Severity.ERROR and f.evidence["normalised_by_num_items"] is False
    mean.train()
    assert any(math.isnan(x) for x in losses.losses)  # an empty micro-batch's mean is NaN and poisons its step
