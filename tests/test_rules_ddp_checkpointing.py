"""DDP + reentrant checkpointing + find_unused_parameters, predicted by the audit and reproduced on 2 gloo ranks."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
from ddp_helpers import _run, read_ranks

import nbguard
from nbguard.testing import tiny_llama

RANKS = Path(__file__).with_name("ddp_checkpoint_ranks.py")


def launch(mode: str, out_dir: Path):
    return _run(lambda port: [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                              "127.0.0.1", "--master_port", str(port), str(RANKS), mode, str(out_dir)], 240)


@pytest.mark.slow
@pytest.mark.multirank  # launches ranks: run by make test-loaded, with both cores busy
def test_reentrant_checkpointing_under_ddp_is_flagged_and_marks_a_variable_ready_twice(tmp_path):
    done = launch("reentrant", tmp_path)
    assert done.returncode == 0, done.stdout[-3000:]
    for rank in read_ranks(tmp_path):
        assert "ddp-reentrant-checkpointing" in rank["rules"]
        assert "mark a variable ready only once" in rank["error"]
        assert rank["signature"] == "ddp-variable-ready-twice"


@pytest.mark.slow
@pytest.mark.multirank  # launches ranks: run by make test-loaded, with both cores busy
def test_non_reentrant_checkpointing_under_ddp_trains_and_stays_quiet(tmp_path):
    done = launch("non-reentrant", tmp_path)
    assert done.returncode == 0, done.stdout[-3000:]
    for rank in read_ranks(tmp_path):
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
