"""DDP + reentrant checkpointing + find_unused_parameters, predicted by the audit and reproduced on 2 gloo ranks."""
from __future__ import annotations

import pytest
from ddp_helpers import CHECKPOINT_BATCH, shared_batch

import nbguard
from nbguard.testing import tiny_llama


def ranks(tmp_path_factory, mode: str) -> list[dict]:
    """Both modes run in one torchrun launch per pytest run (tests/ddp_checkpoint_ranks.py, one after the
    other, each in its own folder); each test reads its mode's ranks (or that mode's own failure)."""
    batch = shared_batch(tmp_path_factory, "checkpointing", "torchrun", CHECKPOINT_BATCH, stall=240)
    return batch.ranks(mode, "-", fn="train_checkpoint_rank")


@pytest.mark.slow
@pytest.mark.multirank  # launches ranks: run by make test-loaded, with both cores busy
def test_reentrant_checkpointing_under_ddp_is_flagged_and_marks_a_variable_ready_twice(tmp_path_factory):
    for rank in ranks(tmp_path_factory, "reentrant"):
        assert "ddp-reentrant-checkpointing" in rank["rules"]
        assert "mark a variable ready only once" in rank["error"]
        assert rank["signature"] == "ddp-variable-ready-twice"


@pytest.mark.slow
@pytest.mark.multirank  # launches ranks: run by make test-loaded, with both cores busy
def test_non_reentrant_checkpointing_under_ddp_trains_and_stays_quiet(tmp_path_factory):
    for rank in ranks(tmp_path_factory, "non-reentrant"):
        assert "ddp-reentrant-checkpointing" not in rank["rules"] and rank["error"] is None


def test_single_process_stays_quiet_and_the_fix_switches_the_model(tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import TrainingArguments

    model = get_peft_model(tiny_llama(), LoraConfig(r=4, target_modules=["q_proj"]))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], gradient_checkpointing=True)
    assert not [f for f in nbguard.audit(model, args=args).findings if f.rule == "ddp-reentrant-checkpointing"]
    result = nbguard.fixes.apply("non-reentrant-checkpointing", model=model, args=args)
    assert result.changed and args.gradient_checkpointing_kwargs == {"use_reentrant": False}
    layer = next(m for _, m in model.named_modules() if getattr(m, "gradient_checkpointing", False))
    assert layer._gradient_checkpointing_func.keywords["use_reentrant"] is False
    compile(nbguard.fixes.code("non-reentrant-checkpointing", trainer="trainer"), "<cell>", "exec")
