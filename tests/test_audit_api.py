"""The audit's public contract: arguments, the result object, the document, the seed cases."""
from __future__ import annotations

import json

import pytest
import torch
from audit_helpers import healthy_peft_model, make_args, make_trainer, seed_peft_model, tiny_gemma3_multimodal

import nbguard
import nbguard.fixes
from nbguard.auditor import RULES, AuditResult, rule
from nbguard.findings import MIME_TYPE, Severity
from nbguard.session import SESSION
from nbguard.testing import tiny_batch, tiny_gemma3, tiny_llama


# ---- arguments ---------------------------------------------------------------------------------
def test_needs_model_or_trainer():
    with pytest.raises(ValueError, match="model=.*trainer="):
        nbguard.audit()


def test_model_must_be_a_module():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        nbguard.audit("gpt2")


def test_trainer_must_be_a_trainer():
    with pytest.raises(TypeError, match="trainer must be a transformers Trainer"):
        nbguard.audit(trainer=object())


def test_args_must_be_training_arguments():
    with pytest.raises(TypeError, match="args must be a transformers TrainingArguments"):
        nbguard.audit(tiny_llama(), args={"fp16": True})


@pytest.mark.parametrize("batch, message", [
    ([1, 2], "batch must be a non-empty dict of tensors"),
    ({"input_ids": [[1, 2]]}, r"the values of \['input_ids'\] are not tensors"),
    ({"labels": torch.ones(1, 2)}, "needs 'input_ids'"),
])
def test_batch_must_be_dict_of_tensors(batch, message):
    with pytest.raises((TypeError, ValueError), match=message):
        nbguard.audit(tiny_llama(), batch=batch)


def test_unknown_hardware_is_named():
    with pytest.raises(ValueError, match="hardware='tpu9'"):
        nbguard.audit(tiny_llama(), hardware="tpu9")


# ---- the result ---------------------------------------------------------------------------------
def test_result_api_and_session_record():
    result = nbguard.audit(seed_peft_model(), hardware="t4")
    assert isinstance(result, AuditResult)
    assert SESSION.last_audit is result
    ranks = [f.severity.rank for f in result.findings]
    assert ranks == sorted(ranks, reverse=True)  # worst first
    assert {"bf16-unsupported", "trainable-low-precision", "zero-embedding-rows"} <= result.rules
    assert "bf16-unsupported" in result and "cache-eval-crash" not in result
    assert result.finding("bf16-unsupported").severity == Severity.ERROR
    assert result.finding("no-such-rule") is None
    assert all(f.severity == Severity.ERROR for f in result.errors)
    assert all(f.severity == Severity.WARNING for f in result.warnings)
    assert result.hardware.name == "t4"
    json.dumps(result.to_dict())


def test_document_carries_fix_cells_with_the_callers_names():
    result = nbguard.audit(seed_peft_model(), hardware="t4")
    doc = result.to_document(names={"model": "my_model"})
    assert doc["kind"] == "audit" and doc["schema_version"] == 1
    assert "packages" in doc["environment"] and doc["hardware"]["name"] == "t4"
    assert [f["rule"] for f in doc["findings"]] == [f.rule for f in result.findings]
    cells = doc["fix_cells"]
    assert set(cells) == {"switch-precision", "upcast-trainable-fp32", "init-new-embeddings"}
    assert "my_model.named_parameters()" in cells["upcast-trainable-fp32"]["code"]
    switch = cells["switch-precision"]["code"]  # t4: fp32, not bf16; no trainer/args exist here
    assert "_param.data.to(torch.float32)" in switch and "trainer" not in switch
    assert cells["init-new-embeddings"]["title"]
    json.dumps(doc)


def test_document_targets_the_trainer_when_audited_through_one(tmp_path):
    trainer = make_trainer(healthy_peft_model(), make_args(tmp_path, max_grad_norm=0.0, bf16=True))
    result = nbguard.audit(trainer=trainer, hardware="t4")
    assert result.target == "trainer"
    cells = result.to_document(names={"trainer": "sft"})["fix_cells"]
    assert "sft.create_accelerator_and_postprocess()" in cells["switch-precision"]["code"]
    assert "sft.args.bf16 = False" in cells["switch-precision"]["code"]


def test_result_displays_through_the_renderers():
    pytest.importorskip("nbguard.render")
    bundle = nbguard.audit(seed_peft_model(), hardware="t4")._repr_mimebundle_()
    assert {"text/plain", "text/html", MIME_TYPE} <= set(bundle)
    assert "bf16-unsupported" in bundle["text/plain"]


def test_a_failing_rule_becomes_an_info_finding():
    @rule("test-broken-rule", "error")
    def broken(ctx):
        raise RuntimeError("boom")

    try:
        result = nbguard.audit(tiny_llama(), hardware="a100")
    finally:
        del RULES["test-broken-rule"]
    f = result.finding("rule-error")
    assert f.severity == Severity.INFO
    assert f.evidence["rule"] == "test-broken-rule" and "boom" in f.evidence["exception"]
    assert "test-broken-rule" not in result


def test_trl_config_is_accepted_as_args(tmp_path):
    trl = pytest.importorskip("trl")
    args = trl.SFTConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_grad_norm=0.0, fp16=True)
    assert "no-grad-clipping" in nbguard.audit(tiny_llama(), args=args, hardware="t4")


def test_trl_sft_trainer_is_audited_and_fixed(tmp_path):
    pytest.importorskip("trl")
    from datasets import Dataset
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    from trl import SFTConfig, SFTTrainer

    vocab = {f"t{i}": i for i in range(128)}  # a word-level tokenizer built in memory: nothing from a hub
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t1")),
                                  pad_token="t0", eos_token="t2", unk_token="t1")
    args = SFTConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], bf16=True, max_steps=1,
                     per_device_train_batch_size=2)
    trainer = SFTTrainer(model=healthy_peft_model(), args=args, processing_class=tok,
                         train_dataset=Dataset.from_dict({"input_ids": [[3, 4, 5, 6, 7, 8]] * 4}))
    result = nbguard.audit(trainer=trainer, hardware="t4")
    assert "bf16-unsupported" in result and result.target == "trainer"
    nbguard.fixes.apply("switch-precision", trainer=trainer, to="fp32")
    assert trainer.accelerator.mixed_precision == "no"
    assert "bf16-unsupported" not in nbguard.audit(trainer=trainer, hardware="t4")


def test_trainer_supplies_model_and_args(tmp_path):
    model = tiny_llama()
    trainer = make_trainer(model, make_args(tmp_path, max_grad_norm=0.0, fp16=False, logging_nan_inf_filter=True))
    result = nbguard.audit(trainer=trainer, hardware="a100")
    assert "nan-filtered-logging" in result  # came from trainer.args


# ---- the seed cases ------------------------------------------------------------------------------
def test_seed_peft_case_flagged_then_clean_after_two_fixes():
    model = seed_peft_model()
    result = nbguard.audit(model, hardware="a100")
    low = result.finding("trainable-low-precision")
    zero = result.finding("zero-embedding-rows")
    assert low is not None and zero is not None
    assert any("lora_embedding_A" in p for p in low.evidence["parameters"]["first"])
    assert zero.evidence["token_ids"] == list(range(128, 136))
    assert zero.evidence["padding_row_ignored"] == 0  # the pad row is zero by design

    nbguard.fixes.apply("upcast-trainable-fp32", model=model)
    nbguard.fixes.apply("init-new-embeddings", model=model)
    after = nbguard.audit(model, hardware="a100")
    assert not after.errors and not after.warnings, after.rules


def test_seed_case_with_modules_to_save_and_untied_llama():
    model = seed_peft_model("llama", target_modules=["q_proj", "v_proj"],
                            modules_to_save=["embed_tokens", "lm_head"])
    zero = nbguard.audit(model, hardware="a100").finding("zero-embedding-rows")
    names = set(zero.evidence["matrices"])
    assert any("modules_to_save" in n for n in names) and any("original_module" in n for n in names)
    assert any("lm_head" in n for n in names)
    nbguard.fixes.apply("upcast-trainable-fp32", model=model)
    nbguard.fixes.apply("init-new-embeddings", model=model)
    after = nbguard.audit(model, hardware="a100")
    assert not after.errors and not after.warnings, after.rules


def test_seed_case_with_trainable_token_indices():
    new = list(range(128, 136))
    model = seed_peft_model(target_modules=["q_proj", "v_proj"], trainable_token_indices={"embed_tokens": new})
    zero = nbguard.audit(model, hardware="a100").finding("zero-embedding-rows")
    assert any("trainable_tokens_delta" in n for n in zero.evidence["matrices"])
    nbguard.fixes.apply("upcast-trainable-fp32", model=model)
    nbguard.fixes.apply("init-new-embeddings", model=model)
    assert "zero-embedding-rows" not in nbguard.audit(model, hardware="a100")
    # The embedding the model really uses for a new token is no longer zero.
    emb = model.get_input_embeddings()(torch.tensor([[130]]))
    assert emb.abs().sum() > 0


@pytest.mark.parametrize("hardware, target", [("t4", "fp32"), ("l4", "bf16")])
def test_gemma3_fp16_switches_to_what_the_hardware_has(tmp_path, hardware, target):
    # TrainingArguments(fp16=True) constructs on CPU (use_cpu=True); a Trainer could not be built with it
    # here (accelerate refuses fp16 mixed precision on CPU), so the args are audited alongside the model.
    args = make_args(tmp_path, fp16=True)
    result = nbguard.audit(tiny_gemma3(), args=args, hardware=hardware)
    f = result.finding("fp16-overflow-risk")
    assert f is not None and f.severity == Severity.ERROR
    assert f.evidence["target_precision"] == target
    assert f.evidence["model_type"] == ["gemma3_text"]
    assert "switch-precision" in f.fixes
    code = result.to_document(names={"model": "model", "args": "args"})["fix_cells"]["switch-precision"]["code"]
    assert f"args.bf16 = {target == 'bf16'}" in code


def test_multimodal_gemma3_is_recognised_through_its_text_config(tmp_path):
    model = tiny_gemma3_multimodal()
    f = nbguard.audit(model, args=make_args(tmp_path, fp16=True), hardware="t4").finding("fp16-overflow-risk")
    assert f.evidence["model_type"] == ["gemma3", "gemma3_text"]


def test_gemma3_bf16_on_t4_is_unsupported(tmp_path):
    result = nbguard.audit(tiny_gemma3(), args=make_args(tmp_path, bf16=True), hardware="t4")
    f = result.finding("bf16-unsupported")
    assert f.evidence["requested_by"] == ["args.bf16=True"] and f.evidence["target_precision"] == "fp32"
    assert "bf16-unsupported" not in nbguard.audit(tiny_gemma3(), args=make_args(tmp_path, bf16=True),
                                                    hardware="l4")


def test_healthy_setup_has_no_error_or_warning(tmp_path):
    args = make_args(tmp_path, bf16=True, max_grad_norm=1.0, learning_rate=2e-4)
    trainer = make_trainer(healthy_peft_model(), args)
    result = nbguard.audit(trainer=trainer, batch=tiny_batch(4, 16), hardware="a100", probe=True)
    assert not result.errors and not result.warnings, result.rules
    assert result.probe is not None and result.probe.modules
