"""fp16=True on the CPU over float16 weights, as axolotl's ``bf16: auto`` leaves a run on a machine without bf16
(it loads the weights in float16, keeps a few in float32, and sets fp16=True): accelerate makes no autocast on the
CPU, so the run computes in the weights' own dtypes, not in fp32, and its first forward fails where float32 meets
float16. The audit of the built Trainer says both before train()."""
from __future__ import annotations

import pytest
import torch
from audit_helpers import make_args
from transformers import Trainer

import nbguard
from nbguard.testing import TinyDataset, tiny_llama


def _fp16_weights_with_an_fp32_norm():
    model = tiny_llama(dtype=torch.float16)
    model.model.norm.float()  # a module kept in float32 beside float16 weights, as axolotl's loader keeps some
    return model


def test_fp16_on_the_cpu_over_half_weights_is_not_called_fp32_and_the_crash_is_predicted(tmp_path):
    trainer = Trainer(model=_fp16_weights_with_an_fp32_norm(), args=make_args(tmp_path, fp16=True, use_cpu=True),
                      train_dataset=TinyDataset(8))
    result = nbguard.audit(trainer, hardware="cpu")
    ignored = result.finding("precision-flag-ignored")
    assert "fp32" not in ignored.title and "float16 and float32" in ignored.title
    assert ignored.evidence["effective"] == "float16+float32"
    crash = result.finding("forward-returns-no-loss")
    assert crash is not None and "dtype" in crash.evidence["exception"]
    assert "model.norm.weight" in crash.detail  # the float32 parameter where the two dtypes meet is named
    with pytest.raises(RuntimeError, match="dtype"):
        trainer.train()  # the claim holds: train() fails as the audit said


def test_fp16_on_the_cpu_over_float32_weights_still_trains_in_fp32(tmp_path):
    trainer = Trainer(model=tiny_llama(), args=make_args(tmp_path, fp16=True, use_cpu=True),
                      train_dataset=TinyDataset(8))
    ignored = nbguard.audit(trainer, hardware="cpu").finding("precision-flag-ignored")
    assert ignored.title.endswith("this run trains in fp32") and ignored.evidence["effective"] == "fp32"
