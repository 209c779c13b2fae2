"""A positive and a negative test for each audit rule, on real tiny models."""
from __future__ import annotations

import functools

import pytest
import torch
from audit_helpers import add_zero_tokens, healthy_peft_model, make_args

import nbguard
from nbguard.auditor import RULES
from nbguard.findings import Severity
from nbguard.testing import tiny_batch, tiny_gemma3, tiny_llama, tiny_qwen2


def audit(*a, **kw):
    kw.setdefault("hardware", "a100")
    return nbguard.audit(*a, **kw)


def test_every_rule_of_the_issue_is_registered():
    expected = {
        "bf16-unsupported", "fp16-overflow-risk", "trainable-low-precision", "fp16-unscale-error",
        "zero-embedding-rows", "cache-eval-crash", "cache-with-checkpointing", "checkpointing-no-input-grads",
        "no-supervised-tokens", "fully-masked-rows", "no-grad-clipping", "optimizer-eps-underflow",
        "nan-filtered-logging", "mixed-param-dtypes", "bnb-compute-dtype",
    }
    assert expected <= set(RULES)
    assert RULES["nan-filtered-logging"].severity == Severity.INFO


# ---- bf16-unsupported ---------------------------------------------------------------------------
def test_bf16_unsupported_from_bf16_trainable_weights():
    model = tiny_qwen2(dtype=torch.bfloat16)
    f = audit(model, hardware="v100").finding("bf16-unsupported")
    assert f.evidence["compute_capability"] == "7.0"
    assert "trainable parameters stored in bfloat16" in f.evidence["requested_by"][0]
    assert "bf16-unsupported" not in audit(model, hardware="h100")
    assert "bf16-unsupported" not in audit(tiny_qwen2(), hardware="v100")  # fp32: nothing asks for bf16


def bnb_4bit(compute_dtype):
    """A BitsAndBytesConfig as from_pretrained(quantization_config=...) leaves on model.config."""
    from transformers import BitsAndBytesConfig

    try:
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=compute_dtype)
    except Exception as exc:  # older transformers insist on bitsandbytes being installed
        pytest.skip(f"BitsAndBytesConfig needs bitsandbytes here: {exc}")


def test_bf16_unsupported_from_bnb_compute_dtype():
    model = tiny_llama()
    model.config.quantization_config = bnb_4bit(torch.bfloat16)
    assert "bnb_4bit_compute_dtype=bfloat16" in audit(model, hardware="t4").finding("bf16-unsupported").evidence[
        "requested_by"]


# ---- fp16-overflow-risk -------------------------------------------------------------------------
def test_fp16_overflow_risk_from_fp16_weights_of_a_gemma():
    f = audit(tiny_gemma3(dtype=torch.float16), hardware="t4").finding("fp16-overflow-risk")
    assert f.evidence["fp16_from"] == ["float16 weights"] and f.evidence["target_precision"] == "fp32"


def test_fp16_overflow_risk_not_for_llama_fp16_nor_gemma_bf16(tmp_path):
    assert "fp16-overflow-risk" not in audit(tiny_llama(), args=make_args(tmp_path, fp16=True), hardware="t4")
    assert "fp16-overflow-risk" not in audit(tiny_gemma3(), args=make_args(tmp_path, bf16=True), hardware="l4")


def test_fp16_overflow_risk_from_the_probe(tmp_path):
    model = tiny_llama()
    with torch.no_grad():  # one "massive activation" channel in the residual stream, as real LLMs have
        model.model.embed_tokens.weight[:, 0] = 40000.0
    args = make_args(tmp_path, fp16=True)
    f = audit(model, args=args, hardware="t4", probe=True).finding("fp16-overflow-risk")
    assert f is not None and f.severity == Severity.ERROR
    near = {m["module"]: m for m in f.evidence["modules_near_limit"]["first"]}
    assert "model.layers.1" in near
    # The final RMSNorm rescales the residual stream: near the limit by its input, not its output.
    assert near["model.norm"]["input_absmax"] >= 40000 > 2 * near["model.norm"]["absmax"]
    assert all(m["headroom"] is None or m["headroom"] <= 2 for m in f.evidence["modules_near_limit"]["first"])
    assert "fp16-overflow-risk" not in audit(tiny_llama(), args=args, hardware="t4", probe=True)


# ---- trainable-low-precision / fp16-unscale-error ------------------------------------------------
def test_trainable_low_precision_and_frozen_half_weights_are_fine():
    model = healthy_peft_model()
    assert "trainable-low-precision" not in audit(model)
    for _name, p in model.named_parameters():
        if not p.requires_grad:  # a frozen bf16 base is the normal LoRA set-up
            p.data = p.data.bfloat16()
    assert "trainable-low-precision" not in audit(model)
    next(p for p in model.parameters() if p.requires_grad).data = torch.zeros(4, 64, dtype=torch.float16)
    f = audit(model).finding("trainable-low-precision")
    assert f.evidence["dtypes"] == ["float16"] and f.evidence["parameters"]["count"] == 1


def test_fp16_unscale_error_matches_what_gradscaler_does(tmp_path):
    model = tiny_llama(dtype=torch.float16)
    f = audit(model, args=make_args(tmp_path, fp16=True), hardware="t4").finding("fp16-unscale-error")
    assert f.severity == Severity.ERROR and f.fixes == ["upcast-trainable-fp32"]
    # The mechanism the rule predicts, with the real GradScaler:
    opt = torch.optim.AdamW(model.parameters())
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model(**tiny_batch(1, 8)).loss.float()).backward()
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        scaler.unscale_(opt)
    assert "fp16-unscale-error" not in audit(tiny_llama(), args=make_args(tmp_path, fp16=True), hardware="t4")
    assert "fp16-unscale-error" not in audit(model, args=make_args(tmp_path), hardware="t4")


# ---- mixed-param-dtypes / bnb-compute-dtype ----------------------------------------------------
def test_mixed_param_dtypes():
    model = tiny_llama(dtype=torch.bfloat16)
    assert "mixed-param-dtypes" not in audit(model)
    model.model.layers[0].to(torch.float16)
    f = audit(model).finding("mixed-param-dtypes")
    assert set(f.evidence["counts"]) == {"bfloat16", "float16"}
    assert f.evidence["float16_parameters"]["first"][0].startswith("model.layers.0.")


def test_bnb_compute_dtype_mismatch(tmp_path):
    model = tiny_llama()
    model.config.quantization_config = bnb_4bit(torch.float16)
    f = audit(model, args=make_args(tmp_path, bf16=True)).finding("bnb-compute-dtype")
    assert f.evidence == {"bnb_4bit_compute_dtype": "float16", "mixed_precision": "bf16", "hardware": "a100"}
    assert "bnb-compute-dtype" not in audit(model, args=make_args(tmp_path, fp16=True))
    assert "bnb-compute-dtype" not in audit(tiny_llama(), args=make_args(tmp_path, bf16=True))


# ---- zero-embedding-rows ------------------------------------------------------------------------
def test_zero_embedding_rows_in_a_plain_model():
    model = add_zero_tokens(tiny_qwen2())
    f = audit(model).finding("zero-embedding-rows")
    assert f.evidence["token_count"] == 8
    assert "zero-embedding-rows" not in audit(tiny_qwen2())  # padding row 0 alone is by design


# ---- cache-with-checkpointing / checkpointing-no-input-grads -------------------------------------
def test_cache_with_checkpointing(tmp_path):
    model = tiny_llama()
    assert "cache-with-checkpointing" not in audit(model)
    assert "cache-with-checkpointing" in audit(model, args=make_args(tmp_path, gradient_checkpointing=True))
    model.config.use_cache = False
    assert "cache-with-checkpointing" not in audit(model, args=make_args(tmp_path, gradient_checkpointing=True))


def _reentrant_checkpointing_without_input_grads(model):
    """What older transformers/PEFT left behind: reentrant checkpointing and no input-grad hook."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    if getattr(model, "_require_grads_hook", None) is not None:  # recent transformers add it themselves
        model.disable_input_require_grads()
    return model


def test_checkpointing_no_input_grads_and_the_real_error():
    model = _reentrant_checkpointing_without_input_grads(healthy_peft_model())
    model.train()
    f = audit(model).finding("checkpointing-no-input-grads")
    assert f.severity == Severity.ERROR and f.evidence["use_reentrant"] is True
    loss = model(**tiny_batch(2, 8)).loss
    with pytest.raises(RuntimeError, match="does not require grad"):
        loss.backward()


def test_checkpointing_no_input_grads_negatives():
    model = healthy_peft_model()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert "checkpointing-no-input-grads" not in audit(model)  # non-reentrant checkpointing needs no hook
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.enable_input_require_grads()
    assert "checkpointing-no-input-grads" not in audit(model)  # the hook is there
    full = _reentrant_checkpointing_without_input_grads(tiny_llama())
    assert "checkpointing-no-input-grads" not in audit(full)  # embeddings train: inputs need grad anyway


@pytest.mark.tf450
def test_plain_checkpointing_on_a_peft_model_fails_on_450():
    # transformers 4.50's gradient_checkpointing_enable() defaults to reentrant checkpointing and adds the
    # input-grad hook only for models with PEFT loaded through transformers, not for a PeftModel.
    import nbguard.fixes

    model = healthy_peft_model()
    model.gradient_checkpointing_enable()
    model.train()
    assert "checkpointing-no-input-grads" in audit(model)
    with pytest.raises(RuntimeError, match="does not require grad"):
        model(**tiny_batch(2, 8)).loss.backward()
    nbguard.fixes.apply("enable-input-require-grads", model=model)
    assert "checkpointing-no-input-grads" not in audit(model)
    model(**tiny_batch(2, 8)).loss.backward()


@pytest.mark.tf450
def test_trainer_checkpointing_args_on_a_peft_model_predicted_on_450(tmp_path):
    from audit_helpers import make_trainer

    import nbguard.fixes

    trainer = make_trainer(healthy_peft_model(), make_args(tmp_path, gradient_checkpointing=True))
    f = audit(trainer=trainer).finding("checkpointing-no-input-grads")
    assert f.evidence["enabled_by"].startswith("args.gradient_checkpointing")
    with pytest.raises(RuntimeError, match="does not require grad"):
        trainer.train()
    trainer = make_trainer(healthy_peft_model(), make_args(tmp_path, gradient_checkpointing=True))
    nbguard.fixes.apply("enable-input-require-grads", trainer=trainer)
    assert "checkpointing-no-input-grads" not in audit(trainer=trainer)
    trainer.train()


def test_trainer_checkpointing_args_not_flagged_where_safe(tmp_path):
    from audit_helpers import make_trainer

    from nbguard.auditor.rules.cache import transformers_checkpointing_defaults

    safe = make_args(tmp_path, gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False})
    assert "checkpointing-no-input-grads" not in audit(trainer=make_trainer(healthy_peft_model(), safe))
    reentrant_default, hooks_itself = transformers_checkpointing_defaults()
    if reentrant_default and not hooks_itself:
        pytest.skip("this transformers really fails with the defaults (see the tf450 test)")
    trainer = make_trainer(healthy_peft_model(), make_args(tmp_path, gradient_checkpointing=True))
    assert "checkpointing-no-input-grads" not in audit(trainer=trainer)
    trainer.train()


def test_transformers_default_checkpointing_is_safe_on_current_releases():
    from nbguard.environment import parsed_version

    if parsed_version("transformers").major < 5:
        pytest.skip("older releases default to reentrant checkpointing without the hook (see the tf450 test)")
    model = healthy_peft_model()
    model.gradient_checkpointing_enable()
    model.train()
    assert "checkpointing-no-input-grads" not in audit(model)
    model(**tiny_batch(2, 8)).loss.backward()


# ---- batch rules --------------------------------------------------------------------------------
def test_no_supervised_tokens_whole_batch_and_some_rows():
    model = tiny_llama()
    batch = tiny_batch(2, 8)
    batch["labels"][:] = -100
    batch["labels"][:, 0] = 5  # the first label is never predicted by a causal LM
    f = audit(model, batch=batch).finding("no-supervised-tokens")
    assert f.severity == Severity.ERROR and f.evidence["rows"]["count"] == 2
    assert torch.isnan(model(**batch).loss)  # the 0/0 the rule predicts
    part = tiny_batch(4, 8, pad_rows=1)
    assert audit(model, batch=part).finding("no-supervised-tokens").severity == Severity.WARNING
    assert "no-supervised-tokens" not in audit(model, batch=tiny_batch(2, 8))


def test_fully_masked_rows():
    f = audit(tiny_llama(), batch=tiny_batch(4, 8, pad_rows=2)).finding("fully-masked-rows")
    assert f.evidence["rows"] == {"first": [2, 3], "count": 2}
    assert "fully-masked-rows" not in audit(tiny_llama(), batch=tiny_batch(4, 8))


# ---- training-argument rules ---------------------------------------------------------------------
def test_no_grad_clipping(tmp_path):
    model = tiny_llama()
    assert "no-grad-clipping" in audit(model, args=make_args(tmp_path, fp16=True, max_grad_norm=0.0), hardware="t4")
    assert "no-grad-clipping" not in audit(model, args=make_args(tmp_path, fp16=True), hardware="t4")
    assert "no-grad-clipping" not in audit(model, args=make_args(tmp_path, max_grad_norm=0.0))


def test_optimizer_eps_underflow(tmp_path):
    model = tiny_llama(dtype=torch.float16)
    f = audit(model, args=make_args(tmp_path), hardware="t4").finding("optimizer-eps-underflow")
    assert f.evidence["eps"] == 1e-8
    assert torch.tensor(f.evidence["eps"], dtype=torch.float16).item() == 0.0  # what the rule says
    assert "optimizer-eps-underflow" not in audit(model, args=make_args(tmp_path, adam_epsilon=1e-4), hardware="t4")
    assert "optimizer-eps-underflow" not in audit(tiny_llama(), args=make_args(tmp_path), hardware="t4")


def test_nan_filtered_logging(tmp_path):
    f = audit(tiny_llama(), args=make_args(tmp_path)).finding("nan-filtered-logging")
    assert f.severity == Severity.INFO
    assert "nan-filtered-logging" not in audit(tiny_llama(), args=make_args(tmp_path, logging_nan_inf_filter=False))
    assert "nan-filtered-logging" not in audit(tiny_llama())


def test_rules_do_not_run_reentrant_partial_by_mistake():
    # _gradient_checkpointing_func is a functools.partial of torch's checkpoint with use_reentrant
    model = tiny_llama()
    model.gradient_checkpointing_enable()
    funcs = {type(getattr(m, "_gradient_checkpointing_func", None)) for m in model.modules()}
    assert functools.partial in funcs
