"""The audit on real bitsandbytes Linear4bit layers (issue 12 section 1): compute dtype read off
each layer, quant type, what prepare_model_for_kbit_training changed, 8-bit optimizer state."""
from __future__ import annotations

import pytest
import torch
from audit_helpers import make_args, make_trainer
from qlora_helpers import qlora

import nbguard
from nbguard.testing import tiny_4bit

torch.set_num_threads(1)
LINEARS = 2 * 7  # two decoder layers x (q, k, v, o, gate, up, down)


def test_the_audit_reads_each_linear4bit_and_not_only_the_config(tmp_path):
    model = tiny_4bit(compute_dtype=torch.float16)
    f = nbguard.audit(model, args=make_args(tmp_path, bf16=True), hardware="a100").finding("bnb-compute-dtype")
    assert f.severity == "warning" and f.evidence["bnb_4bit_compute_dtype"] == "float16"
    assert f.evidence["layers_4bit"] == LINEARS and f.evidence["compute_dtypes"] == {"float16": LINEARS}
    assert f.evidence["quant_types"] == {"nf4": LINEARS} and f.evidence["config_compute_dtype"] == "float16"
    # the layers are what computes: a config that says bf16 does not hide fp16 layers
    model.config.quantization_config.bnb_4bit_compute_dtype = torch.bfloat16
    f = nbguard.audit(model, args=make_args(tmp_path, bf16=True), hardware="a100").finding("bnb-compute-dtype")
    assert f.evidence["compute_dtypes"] == {"float16": LINEARS} and f.evidence["config_compute_dtype"] == "bfloat16"
    # and layers moved to bf16 are seen as such, whatever the config says
    for m in model.modules():
        if hasattr(m, "compute_dtype"):
            m.compute_dtype = torch.bfloat16
    model.config.quantization_config.bnb_4bit_compute_dtype = torch.float16
    assert "bnb-compute-dtype" not in nbguard.audit(model, args=make_args(tmp_path, bf16=True), hardware="a100")


def test_fp16_compute_under_a_precision_that_cannot_hold_the_activations_is_an_error(tmp_path):
    """Gemma 3 in 4-bit, fp16 compute, trained in fp32 on a T4: the 4-bit matmuls still run in fp16."""
    model = tiny_4bit("gemma3", compute_dtype=torch.float16)
    result = nbguard.audit(model, args=make_args(tmp_path), hardware="t4")
    f = result.finding("bnb-compute-dtype")
    assert f.severity == "error" and "switch-precision" in f.fixes
    assert f.evidence["training_precision"] == "fp32" and f.evidence["target_precision"] == "fp32"
    assert any("gemma3" in why for why in f.evidence["fp16_overflow"])
    assert "fp16-overflow-risk" not in result  # weights fp32, no fp16 flag: only the 4-bit layers say fp16
    # negative: the same model computing in fp32 is fine on a T4 trained in fp32
    fp32 = tiny_4bit("gemma3", compute_dtype=torch.float32)
    assert "bnb-compute-dtype" not in nbguard.audit(fp32, args=make_args(tmp_path), hardware="t4")
    # negative: a Llama computing in fp16 under fp16 training has nothing to overflow
    assert "bnb-compute-dtype" not in nbguard.audit(tiny_4bit(), args=make_args(tmp_path, fp16=True), hardware="t4")


def test_bf16_compute_on_a_t4_is_bf16_unsupported():
    model = tiny_4bit(compute_dtype=torch.bfloat16)
    f = nbguard.audit(model, hardware="t4").finding("bf16-unsupported")
    assert "bnb_4bit_compute_dtype=bfloat16" in f.evidence["requested_by"]
    assert "bf16-unsupported" not in nbguard.audit(tiny_4bit(compute_dtype=torch.float16), hardware="t4")


def test_the_audit_shows_lora_on_4bit_and_what_prepare_model_for_kbit_training_changed(tmp_path):
    raw = qlora(dtype=torch.float16, prepare=False)
    prepared = qlora(dtype=torch.float16, prepare=True)
    args = make_args(tmp_path, bf16=True)
    before = nbguard.audit(raw, args=args, hardware="a100")
    after = nbguard.audit(prepared, args=args, hardware="a100")
    assert before.finding("bnb-compute-dtype").evidence["kbit_prepared"] is False
    assert after.finding("bnb-compute-dtype").evidence["kbit_prepared"] is True
    assert after.finding("bnb-compute-dtype").evidence["lora_on_4bit"] == 4  # q/v in two layers
    assert before.stack["quantization"]["kbit_prepared"] is False and after.stack["quantization"]["layers_4bit"] == 14
    # the fp16 norms and embeddings prepare_model_for_kbit_training upcast are gone from the mixed findings
    assert "trainable-low-precision" not in after


def test_8bit_optimizer_state_on_the_trainable_output_head(tmp_path):
    """Real bitsandbytes 8-bit paged AdamW through a Trainer: embed_tokens is kept 32-bit by the
    Trainer, the trainable lm_head copy is not."""
    model = qlora(prepare=True, modules_to_save=["lm_head"])
    trainer = make_trainer(model, make_args(tmp_path, optim="paged_adamw_8bit"))
    predicted = nbguard.audit(trainer=trainer, hardware="t4").finding("bnb-8bit-embedding-state")
    assert predicted.evidence["optimizer"] == "args.optim=paged_adamw_8bit"
    assert any("lm_head" in p for p in predicted.evidence["parameters"]["first"])
    with pytest.warns(UserWarning):  # paged optimizers fall back to plain buffers on CPU
        trainer.train()
    seen = nbguard.audit(trainer=trainer, hardware="t4").finding("bnb-8bit-embedding-state")
    assert seen.evidence["optimizer"].startswith("optimizer ")  # read off the real optimizer state
    assert any("lm_head" in p for p in seen.evidence["parameters"]["first"])


def test_8bit_state_is_quiet_when_the_head_is_overridden_to_32bit_or_the_optimizer_is_32bit(tmp_path):
    from bitsandbytes.optim import GlobalOptimManager

    model = qlora(prepare=True, modules_to_save=["lm_head"])
    head = [p for n, p in model.named_parameters() if "lm_head" in n and p.requires_grad]
    manager = GlobalOptimManager.get_instance()
    manager.override_config(head, "optim_bits", 32)
    try:
        trainer = make_trainer(model, make_args(tmp_path, optim="paged_adamw_8bit"))
        assert "bnb-8bit-embedding-state" not in nbguard.audit(trainer=trainer, hardware="t4")
    finally:
        for p in head:
            manager.pid2config.pop(id(p), None)
    trainer = make_trainer(qlora(prepare=True, modules_to_save=["lm_head"]), make_args(tmp_path, optim="adamw_torch"))
    assert "bnb-8bit-embedding-state" not in nbguard.audit(trainer=trainer, hardware="t4")
