"""The audit predicts Liger's crash on a machine where Triton cannot launch a kernel (issue 44 item 6),
before train(), and stays quiet where the kernels can run or Liger is not asked for; and it warns about
Liger's fused loss with reduction='none' in the releases whose gradients were wrong (Liger-Kernel#968)."""
from __future__ import annotations

import pytest
import torch
from liger_helpers import needs_liger, run_child
from packaging.version import Version

import nbguard
from nbguard.testing import TinyDataset, tiny_llama

needs_liger()
if torch.cuda.is_available():  # Triton has its driver there: the crash these tests predict cannot happen
    pytest.skip("Triton has a driver on a CUDA machine", allow_module_level=True)

NO_DRIVER = "liger-no-triton-driver"


def _trainer(**args):
    from transformers import Trainer, TrainingArguments

    training_args = TrainingArguments(output_dir="/tmp/nbguard-liger-audit", max_steps=1, use_cpu=True,
                                      per_device_train_batch_size=2, report_to=[], save_strategy="no", **args)
    return Trainer(model=tiny_llama(), args=training_args, train_dataset=TinyDataset(rows=4))


def test_use_liger_kernel_without_a_triton_driver_is_predicted_before_train():
    trainer = _trainer(use_liger_kernel=True)
    found = nbguard.audit(trainer=trainer).finding(NO_DRIVER)
    assert found is not None and found.severity.value == "error"
    assert "0 active drivers" in found.detail and "use_liger_kernel=False" in found.detail
    assert "GPU" in found.detail
    assert found.evidence["use_liger_kernel"] is True and found.evidence["active_drivers"] == []
    assert found.evidence["triton_interpret"] is False
    # the healthy twin: the same run without Liger
    assert NO_DRIVER not in nbguard.audit(trainer=_trainer()).rules


@pytest.mark.slow  # a child process: Liger patches transformers' modules for good
def test_a_model_patched_by_liger_is_predicted_and_train_really_crashes_as_said():
    """The model patched in place by liger's own _apply_liger_kernel_to_instance (no TrainingArguments):
    the audit names the patched modules, and the forward it predicts to crash does crash."""
    result = run_child("""
        import nbguard, torch
        from liger_kernel.transformers import _apply_liger_kernel_to_instance
        from nbguard.testing import tiny_llama, tiny_batch
        model = tiny_llama()
        _apply_liger_kernel_to_instance(model=model)
        found = nbguard.audit(model).finding("liger-no-triton-driver")
        try:
            model(**tiny_batch())
            crash = None
        except RuntimeError as exc:
            crash = str(exc)
        emit({"finding": found.to_dict() if found else None, "crash": crash})
    """)
    found = result["finding"]
    assert found is not None and found["evidence"]["use_liger_kernel"] is False
    patched = found["evidence"]["patched_modules"]["first"]
    assert "" in patched and "model.norm" in patched  # the model's forward (the fused loss) and its RMSNorms
    assert "apply_liger_kernel_to_*" in found["detail"]
    assert result["crash"].startswith("0 active drivers")


def test_the_interpreter_set_after_liger_kernels_were_defined_does_not_count(monkeypatch):
    """Triton reads TRITON_INTERPRET when a kernel is defined: set after liger_kernel's import it changes nothing."""
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss  # noqa: F401  (defines the kernels)

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    found = nbguard.audit(trainer=_trainer(use_liger_kernel=True)).finding(NO_DRIVER)
    assert found is not None and found.evidence["interpret_set_too_late"] is True
    assert "before liger_kernel is imported" in found.detail



def _trainer_with_fused_loss(reduction: str):
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    trainer = _trainer()
    trainer.fused_loss = LigerFusedLinearCrossEntropyLoss(reduction=reduction)
    return trainer


def test_fused_loss_with_reduction_none_is_warned_about_in_releases_before_the_fix(monkeypatch):
    import nbguard.auditor.rules.liger as rules

    trainer = _trainer_with_fused_loss("none")
    # the installed liger-kernel has the fix (PR #1298): quiet
    assert Version(rules.liger_version().base_version) >= Version("0.8.2")
    assert "liger-fused-loss-reduction-none" not in nbguard.audit(trainer=trainer).rules
    # the same real loss object read as an install of 0.8.1, the last release with the bug
    monkeypatch.setattr(rules, "liger_version", lambda: Version("0.8.1"))
    found = nbguard.audit(trainer=trainer).finding("liger-fused-loss-reduction-none")
    assert found is not None and found.evidence["losses"]["first"] == ["trainer.fused_loss"]
    assert "Liger-Kernel#968" in found.detail and "0.8.2" in found.detail
    # the healthy twin: a mean-reduced fused loss
    assert "liger-fused-loss-reduction-none" not in nbguard.audit(trainer=_trainer_with_fused_loss("mean")).rules


def test_trl_sft_config_asking_for_liger_is_predicted():
    """TRL's SFTTrainer keeps Liger's layer kernels (it turns only the fused loss off): the same crash."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from nbguard.testing import word_tokenizer

    args = SFTConfig(output_dir="/tmp/nbguard-liger-sft", use_liger_kernel=True, use_cpu=True, report_to="none",
                     max_steps=1, max_length=16, save_strategy="no")
    trainer = SFTTrainer(model=tiny_llama(), args=args, processing_class=word_tokenizer(),
                         train_dataset=Dataset.from_list([{"text": "w3 w4 w5 w6"}] * 4))
    found = nbguard.audit(trainer=trainer).finding(NO_DRIVER)
    assert found is not None and "SFTConfig(use_liger_kernel=True)" in found.detail
