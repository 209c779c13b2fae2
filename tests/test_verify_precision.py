"""A verdict runs the precision of the cell it offers: bf16 autocast and bf16 frozen weights for a switch
to bf16, what the Trainer's accelerator really enters on this machine, and the cell text it verified."""
from __future__ import annotations

import tempfile

import pytest
import torch
from audit_helpers import make_args, make_trainer

import nbguard
from nbguard.step.precision import args_mixed_precision, trainer_autocast
from nbguard.testing import plant_fp16_overflow_token, tiny_batch, tiny_llama

torch.set_num_threads(1)
HOT = 7


def _bf16_checkpoint_loaded_in_fp16(train_only: tuple[str, ...] | None = None):
    """A bf16-saved tiny Llama with a token that overflows fp16, loaded with dtype=float16;
    ``train_only``: LoRA-like, only parameters with these name endings train."""
    from transformers import AutoModelForCausalLM

    model = tiny_llama()
    plant_fp16_overflow_token(model, HOT)
    path = tempfile.mkdtemp()
    model.to(torch.bfloat16).save_pretrained(path)
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float16)
    for name, p in loaded.named_parameters():
        p.requires_grad_(train_only is None or name.endswith(train_only))
    return loaded


def _verify(model, args, fix_id, **options):
    batch = tiny_batch(2, 12, model.config.vocab_size, seed=3)
    batch["input_ids"][0, 4] = HOT
    finding = next(f for f in nbguard.audit(model=model, args=args).findings if "switch-precision" in f.fixes)
    v = nbguard.verify(finding, model=model, args=args, batch=batch, fix_id=fix_id,
                       options={fix_id: options} if options else None)
    assert v.baseline is not None and not v.baseline.healthy  # fp16 weights overflow q_proj
    return v


def test_switch_to_bf16_runs_bf16_autocast_and_differs_from_upcast(tmp_path):
    model = _bf16_checkpoint_loaded_in_fp16()
    args = make_args(tmp_path, fp16=True)  # on CPU accelerate runs this in fp32: no autocast
    v = _verify(model, args, "switch-precision", to="bf16")
    switch = v.verdicts[0]
    assert switch.verdict == "verified", switch.reason
    assert switch.step.precision == "autocast cpu bfloat16; trainable 21 float32"
    assert switch.changes["autocast"] == "no autocast -> autocast cpu bfloat16"
    # the verdict carries the cell it ran: the one that sets bf16=True
    assert "args.bf16 = True" in switch.code and "torch.bfloat16" in switch.code
    upcast = _verify(model, args, "upcast-trainable-fp32").verdicts[0]
    assert upcast.verdict == "verified" and upcast.step.precision == "no autocast; trainable 21 float32"
    assert upcast.step.loss != switch.step.loss  # not the same fp32 step under another name
    # the document and the views read the cell from the verdict
    doc = v.to_dict()["verdicts"][0]
    assert doc["code"] == switch.code and doc["step"]["precision"] == switch.step.precision


def test_switch_to_bf16_casts_frozen_weights_to_bfloat16(tmp_path):
    model = _bf16_checkpoint_loaded_in_fp16(train_only=("q_proj.weight", "v_proj.weight"))
    switch = _verify(model, make_args(tmp_path, fp16=True), "switch-precision", to="bf16").verdicts[0]
    assert switch.verdict == "verified", switch.reason
    assert switch.step.precision == "autocast cpu bfloat16; trainable 4 float32; frozen 17 bfloat16"
    assert all(p.dtype == torch.float16 for p in model.parameters())  # the user's model is untouched


def test_trainer_autocast_is_what_the_trainers_accelerator_enters(tmp_path):
    """Differential: the real Trainer's accelerator on this CPU against the step layer's answer."""
    from accelerate.state import AcceleratorState

    for flags, expected in (({"fp16": True}, []), ({"bf16": True}, [("cpu", torch.bfloat16)]), ({}, [])):
        AcceleratorState._reset_state()
        trainer = make_trainer(tiny_llama(), make_args(tmp_path, **flags))
        accelerator = trainer.accelerator
        entered = [("cpu", torch.bfloat16)] if accelerator.native_amp and accelerator.mixed_precision == "bf16" else (
            [("cpu", torch.float16)] if accelerator.native_amp else [])
        assert trainer_autocast(args_mixed_precision(trainer.args), "cpu") == entered == expected
    AcceleratorState._reset_state()


def test_the_audits_card_offers_the_cell_its_verdict_ran(tmp_path):
    model = _bf16_checkpoint_loaded_in_fp16()
    batch = tiny_batch(2, 12, model.config.vocab_size, seed=3)
    batch["input_ids"][0, 4] = HOT
    result = nbguard.audit(model=model, args=make_args(tmp_path, fp16=True), batch=batch, hardware="cpu", verify=True)
    switch = result.verification.verdict("switch-precision")
    assert switch.options == {"to": "bf16"} and switch.verdict == "verified", switch.reason
    assert switch.step.precision.startswith("autocast cpu bfloat16")
    doc = result.to_document()
    assert doc["fix_cells"]["switch-precision"]["code"] == switch.code  # the card's cell is the one verified


def test_a_precision_this_machine_cannot_run_is_named():
    from nbguard.step.precision import PrecisionUnavailable

    if torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False):
        assert trainer_autocast("bf16", "cuda") == [("cuda", torch.bfloat16)]
    else:
        with pytest.raises(PrecisionUnavailable, match="no native bf16: a Trainer with bf16=True refuses"):
            trainer_autocast("bf16", "cuda")
    assert trainer_autocast("fp16", "cuda") == [("cuda", torch.float16)]
    with pytest.raises(ValueError, match="mixed_precision must be 'bf16', 'fp16' or 'no'; got 'fp8'"):
        trainer_autocast("fp8", "cpu")
