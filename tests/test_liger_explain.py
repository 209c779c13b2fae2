"""`nbguard.explain(exc)` on Triton's "0 active drivers" (issue 44 item 6): the real exception a Trainer
with use_liger_kernel=True raises on a CPU machine names Liger, Triton and the fix; the audit run before
train() predicted the same crash."""
from __future__ import annotations

import pytest
import torch
from liger_helpers import needs_liger, run_child

import nbguard

if torch.cuda.is_available():
    pytest.skip("Triton has a driver on a CUDA machine: train() does not crash", allow_module_level=True)


@pytest.mark.slow  # a child process: Liger patches transformers' modules for good
def test_the_real_trainer_crash_is_explained_and_was_predicted():
    needs_liger()
    result = run_child("""
        import nbguard
        from transformers import Trainer, TrainingArguments
        from nbguard.testing import tiny_llama, TinyDataset
        args = TrainingArguments(output_dir="/tmp/nbguard-liger-explain", use_liger_kernel=True, use_cpu=True,
                                 per_device_train_batch_size=2, report_to=[], max_steps=1, save_strategy="no")
        trainer = Trainer(model=tiny_llama(), args=args, train_dataset=TinyDataset(rows=4))
        predicted = "liger-no-triton-driver" in nbguard.audit(trainer=trainer).rules
        try:
            trainer.train()
            emit({"crashed": False})
        except Exception as exc:
            diagnosis = nbguard.explain(exc)
            emit({"crashed": True, "predicted": predicted, "exception": f"{type(exc).__name__}: {exc}",
                  "diagnosis": diagnosis.to_dict() if diagnosis else None})
    """)
    assert result["crashed"] and result["exception"].startswith("RuntimeError: 0 active drivers")
    assert result["predicted"]
    diagnosis = result["diagnosis"]
    assert diagnosis is not None and diagnosis["signature"] == "triton-no-active-driver"
    assert "Liger" in diagnosis["title"]
    assert diagnosis["evidence"]["liger_frame"].startswith("ops/")  # the Liger kernel that was launched
    assert "use_liger_kernel=False" in diagnosis["detail"] and "GPU" in diagnosis["detail"]


def test_the_message_as_pasted_is_recognised_without_its_traceback():
    pasted = RuntimeError("0 active drivers ([]).\n  There should only be one.")
    diagnosis = nbguard.explain(pasted)
    assert diagnosis is not None and diagnosis.signature == "triton-no-active-driver"
    assert diagnosis.evidence["liger_frame"] is None
    assert "use_liger_kernel=False" in diagnosis.detail
    # its twin: Triton finding two drivers is another problem
    assert nbguard.explain(RuntimeError("2 active drivers ([a, b]). There should only be one.")) is None
