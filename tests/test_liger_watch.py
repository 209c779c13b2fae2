"""The watch localises a NaN through Liger's fused linear cross-entropy (issue 44 item 6): the fused loss
never materialises the logits (``logits=None``) and reads ``lm_head.weight`` inside its kernel, so no hook
sees lm_head run. An inf planted in ``lm_head.weight`` is named there, as it is without Liger, with the
hidden states that entered the fused loss and the fused kernel that read it, not "invalid-op in <model>".

Liger's kernels run for real on CPU in Triton's interpreter (TRITON_INTERPRET=1 in a child process).
Only the fused loss is applied: Liger's RMSNorm kernel does not run in Triton 3.9's interpreter
(InterpreterError "'float' object has no attribute 'to'"), and the fused loss is what this is about.
The audit's own check of a run in the interpreter shares the child (a fresh Python's imports are most of its time).
"""
from __future__ import annotations

import pytest
import torch
from liger_helpers import needs_liger, run_child

NO_DRIVER = "liger-no-triton-driver"

if torch.cuda.is_available():
    pytest.skip("runs Liger's kernels in Triton's CPU interpreter", allow_module_level=True)

_RUN = """
    import jsonschema, torch, nbguard
    from nbguard.document import encode_document
    from nbguard.document.schema import schema
    from transformers import Trainer, TrainingArguments
    from nbguard.testing import tiny_llama, TinyDataset

    def first_event(peft=False, **liger):
        model = tiny_llama()
        if peft:  # lm_head trained through PEFT's ModulesToSaveWrapper: the weight Liger reads is one level down
            from peft import LoraConfig, get_peft_model
            model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]))
        head = model.get_output_embeddings()
        with torch.no_grad():
            (head.modules_to_save.default if peft else head).weight[5, 3] = float("inf")
        args = TrainingArguments(output_dir="/tmp/nbguard-liger-watch", use_cpu=True, per_device_train_batch_size=2,
                                 report_to=[], max_steps=1, save_strategy="no", **liger)
        trainer = Trainer(model=model, args=args, train_dataset=TinyDataset(rows=2))
        watch = nbguard.watch(trainer)
        trainer.train()
        event = watch.events[0]
        jsonschema.Draft202012Validator(schema()).validate(encode_document(watch.to_document()))
        return {"message": event.message, "cause": event.cause, "origin": event.origins[0].to_dict()}

    def audited_and_trained():  # a healthy run: what the audit says in the interpreter, and that train() runs
        from nbguard.introspect.liger import triton_state
        args = TrainingArguments(output_dir="/tmp/nbguard-liger-audit", use_liger_kernel=True, use_cpu=True,
                                 liger_kernel_config=only_fused_loss,
                                 per_device_train_batch_size=2, report_to=[], max_steps=1, save_strategy="no")
        trainer = Trainer(model=tiny_llama(), args=args, train_dataset=TinyDataset(rows=2))
        rules = sorted(nbguard.audit(trainer=trainer).rules)
        trainer.train()
        return {"rules": rules, "triton": triton_state().to_dict(),
                "loss": trainer.state.log_history[-1]["train_loss"]}

    only_fused_loss = {"rms_norm": False, "swiglu": False, "rope": False}
    audited = audited_and_trained()  # first: nothing else ran Liger's kernels in this process yet
    plain = first_event()
    fused = first_event(use_liger_kernel=True, liger_kernel_config=only_fused_loss)
    peft = first_event(peft=True, use_liger_kernel=True, liger_kernel_config=only_fused_loss)
    emit({"plain": plain, "fused": fused, "peft": peft, "audited": audited})
"""


@pytest.fixture(scope="module")
def interpreted():
    needs_liger()
    return run_child(_RUN, interpret=True)


@pytest.mark.slow  # a child process: Liger patches transformers' modules for good
def test_an_inf_in_lm_head_read_by_liger_fused_loss_is_named_in_lm_head(interpreted):
    result = interpreted
    plain, fused = result["plain"], result["fused"]
    # without Liger: lm_head runs as a module and its weight is named
    assert (plain["cause"], plain["origin"]["module"], plain["origin"]["tensor"]) == (
        "nonfinite-parameter", "lm_head", "weight")
    # with Liger's fused loss: the same parameter, and the kernel that read it
    origin = fused["origin"]
    assert (fused["cause"], origin["module"], origin["tensor"]) == ("nonfinite-parameter", "lm_head", "weight")
    assert "<model>" not in fused["message"] and "in LlamaForCausalLM.forward" in fused["message"]
    assert "Liger's fused linear cross-entropy" in fused["message"] and "logits never materialised" in fused["message"]
    assert origin["evidence"]["nonfinite_values"] == {"weight": 1}
    hidden = origin["evidence"]["hidden_states"]
    assert hidden["module"] == "model" and hidden["finite"] is True and 0 < hidden["absmax"] < 1e3
    assert origin["input_absmax"] == hidden["absmax"]
    # train() really applied Liger's fused-loss forward, and the replay names it
    assert "lce_forward" in origin["evidence"]["fused_loss"] and origin["evidence"]["read_by"] == "LlamaForCausalLM.forward"
    # through PEFT: the wrapper Liger reads lm_head's weight through, and the weight it holds
    peft = result["peft"]
    assert (peft["cause"], peft["origin"]["module"], peft["origin"]["tensor"]) == (
        "nonfinite-parameter", "base_model.model.lm_head", "modules_to_save.default.weight")
    assert "Liger's fused linear cross-entropy" in peft["message"]


@pytest.mark.slow  # a child process: Liger patches transformers' modules for good
def test_the_interpreter_set_before_triton_makes_the_rule_quiet_and_train_runs(interpreted):
    """Only the fused loss is applied: Liger's RMSNorm kernel does not run in Triton 3.9's interpreter."""
    result = interpreted["audited"]
    assert NO_DRIVER not in result["rules"]
    assert result["triton"]["triton_interpret"] is True and result["triton"]["active_drivers"] == []
    assert 0 < result["loss"] < 10  # Liger's fused loss really ran, in the interpreter
