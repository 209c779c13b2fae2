"""Unsloth-aware audit, fixes and explainer, on real tiny models carrying the markers Unsloth sets
(see nbguard/introspect/unsloth.py for where each marker comes from in Unsloth's source). Unsloth
itself is not imported: it needs a GPU."""
from __future__ import annotations

import pytest
import torch
from audit_helpers import make_args, make_trainer
from transformers import Trainer

import nbguard
import nbguard.fixes
from nbguard.introspect.unsloth import read_unsloth
from nbguard.testing import tiny_4bit, tiny_batch, tiny_gemma3, tiny_llama

torch.set_num_threads(1)


def _as_unsloth_loaded(model, forced_float32: bool):
    """What FastModel.from_pretrained stamps (unsloth/models/llama.py, unsloth/models/_utils.py)."""
    model.config.update({"unsloth_version": "2026.10.9"})
    model._unsloth_forced_float32 = forced_float32
    model._unsloth_full_finetuning = False
    return model


def _forced_args(tmp_path):
    """Unsloth's trainer in forced-float32 mode turns autocast off (unsloth/models/rl.py)."""
    return make_args(tmp_path, fp16=False, bf16=False)


def test_a_float32_forced_gemma_stored_in_fp16_with_autocast_off_raises_no_fp16_error(tmp_path):
    model = _as_unsloth_loaded(tiny_gemma3(dtype=torch.float16), forced_float32=True)
    result = nbguard.audit(model, args=_forced_args(tmp_path), hardware="t4")
    assert not [f.rule for f in result.errors if "fp16" in f.rule], [f.rule for f in result.errors]
    facts = result.stack["unsloth"]
    assert facts["loaded"] is True and facts["forced_float32"] is True
    assert facts["forced_from"] == "model._unsloth_forced_float32" and facts["version"] == "2026.10.9"


def test_without_the_markers_or_with_autocast_on_the_same_model_is_an_fp16_error(tmp_path):
    plain = tiny_gemma3(dtype=torch.float16)
    assert nbguard.audit(plain, args=_forced_args(tmp_path), hardware="t4").finding(
        "fp16-overflow-risk").severity == "error"
    assert "unsloth" not in nbguard.audit(plain, hardware="t4").stack
    forced = _as_unsloth_loaded(tiny_gemma3(dtype=torch.float16), forced_float32=True)
    # fp16 autocast back on: no longer Unsloth's forced mode, the risk is real
    assert "fp16-overflow-risk" in nbguard.audit(forced, args=make_args(tmp_path, fp16=True), hardware="t4")


def test_4bit_fp16_compute_is_unsloths_choice_in_forced_float32_mode(tmp_path):
    forced = _as_unsloth_loaded(tiny_4bit("gemma3", compute_dtype=torch.float16, dtype=torch.float16), True)
    assert "bnb-compute-dtype" not in nbguard.audit(forced, args=_forced_args(tmp_path), hardware="t4")
    plain = tiny_4bit("gemma3", compute_dtype=torch.float16, dtype=torch.float16)
    assert nbguard.audit(plain, args=_forced_args(tmp_path), hardware="t4").finding(
        "bnb-compute-dtype").severity == "error"


def test_the_env_switch_answers_when_the_model_has_no_stamp(monkeypatch):
    model = tiny_llama()
    model.config.update({"unsloth_version": "2026.10.9"})
    monkeypatch.setenv("UNSLOTH_FORCE_FLOAT32", "1")
    monkeypatch.setenv("UNSLOTH_MIXED_PRECISION", "float32")
    facts = read_unsloth(model)
    assert facts.forced_float32 is True and facts.forced_from == "env UNSLOTH_FORCE_FLOAT32"
    assert facts.mixed_precision == "float32"
    monkeypatch.setenv("UNSLOTH_FORCE_FLOAT32", "0")
    assert read_unsloth(model).forced_float32 is False
    assert read_unsloth(tiny_llama()).any is False  # no marker: the env alone does not make a model Unsloth's


def test_the_stamp_is_found_under_peft_and_the_trainer_by_its_generated_class(tmp_path):
    from peft import LoraConfig, get_peft_model

    base = _as_unsloth_loaded(tiny_llama(), forced_float32=False)
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj"]))
    assert read_unsloth(model).loaded is True and read_unsloth(model).forced_float32 is False

    class UnslothSFTTrainer(Trainer):  # the name patch_trl_rl_trainers gives its classes
        pass

    trainer = UnslothSFTTrainer(model=tiny_llama(), args=make_args(tmp_path))
    facts = read_unsloth(trainer.model, trainer, trainer.args)
    assert facts.trainer is True and facts.loaded is False
    assert read_unsloth(tiny_llama(), make_trainer(tiny_llama(), make_args(tmp_path))).any is False


def test_fixes_on_an_unsloth_setup_are_unsloths_own_and_never_undo_what_it_set(tmp_path):
    model = _as_unsloth_loaded(tiny_gemma3(dtype=torch.float16), forced_float32=True)
    args = make_args(tmp_path, fp16=True)  # the user turned fp16 back on over Unsloth's choice
    result = nbguard.audit(model, args=args, hardware="t4")
    f = result.finding("fp16-overflow-risk")
    assert f.fixes == ["unsloth-precision"]
    fixed = nbguard.fixes.apply("unsloth-precision", model=model, args=args,
                                **result.fix_options("unsloth-precision"))
    assert fixed.changed == {"args.fp16": "True -> False"}  # back to Unsloth's forced-float32 flags
    assert "FastLanguageModel.from_pretrained" in fixed.code and "dtype=None" in fixed.code
    assert {p.dtype for p in model.parameters()} == {torch.float16}  # no cast: storage stays as Unsloth chose
    assert "fp16-overflow-risk" not in nbguard.audit(model, args=args, hardware="t4")
    assert nbguard.fixes.apply("unsloth-precision", model=model, args=args, bf16=False).changed == {}
    with pytest.raises(ValueError, match="for models loaded with Unsloth"):
        nbguard.fixes.apply("unsloth-precision", model=tiny_llama(), args=args)
    # switch-precision would cast behind Unsloth's back: refused with the way out
    with pytest.raises(ValueError, match="set up by Unsloth.*unsloth-precision"):
        nbguard.fixes.apply("switch-precision", model=model, args=args, to="fp32")
    assert {p.dtype for p in model.parameters()} == {torch.float16}


def _sampling_error_after_a_switch():
    """A precision switch applied, then sampling from a model whose weights already hold NaN (an earlier
    blow-up the switch cannot undo): torch.multinomial's real error, whose diagnosis offers the switch."""
    model = tiny_llama(dtype=torch.float16)
    assert nbguard.fixes.apply("switch-precision", model=model, to="fp32").changed
    with torch.no_grad():
        model.lm_head.weight[0, 0] = float("nan")
    with pytest.raises(RuntimeError) as info:
        model.generate(tiny_batch(1, 4)["input_ids"], do_sample=True, max_new_tokens=2, pad_token_id=0)
    return info.value


def test_the_explainer_never_proposes_again_the_fix_that_came_before_the_error():
    from nbguard.session import SESSION

    error = _sampling_error_after_a_switch()
    diagnosis = nbguard.explain(error)
    assert diagnosis.signature == "sampling-nonfinite-probs"
    assert "switch-precision" not in diagnosis.fixes
    assert diagnosis.evidence["fixes_already_applied"] == ["switch-precision"]
    assert "already applied" in diagnosis.detail
    SESSION.clear()  # a fresh session: the same error gets the fix offered
    assert "switch-precision" in nbguard.explain(error).fixes
