"""Issue 43 item 2: the RL memory audit counts vLLM's colocated share, the training state and the logits of the
configured completion length against the GPU, and names the setting that fits (unsloth#3302, trl#3678).

No GPU and no vLLM here. What runs: the audit on real TRL configs and trainers and real models (a Llama-3-8B
shape on the meta device; a tiny Qwen2 GRPOTrainer), judged against named GPU profiles. What is not run: the
OOM itself. The full-logits case is the trainer with TRL's fused LM head taken off its model, as TRL before
the fused head built it (TRL 1.16 scores completions in tiles and never materialises the logits).
"""
from __future__ import annotations

import pytest
import torch
from rl_helpers import grpo_trainer

import nbguard
from nbguard.auditor.context import AuditContext
from nbguard.auditor.memory import GIB
from nbguard.auditor.rules.rollout_memory import rollout_oom
from nbguard.hardware import Hardware, resolve_hardware
from nbguard.testing import meta_llama_8b

pytest.importorskip("trl")


def lora_shaped_8b():
    """Llama-3-8B in bf16 on the meta device, trainable as LoRA leaves it: a few projections of one layer."""
    model = meta_llama_8b().to(torch.bfloat16)
    for name, p in model.named_parameters():
        p.requires_grad = "q_proj" in name and "layers.0." in name
    return model


def grpo_config(tmp_path, **settings):
    from trl import GRPOConfig

    return GRPOConfig(output_dir=str(tmp_path / "grpo"), use_cpu=True, report_to=[], **settings)


def oom(result):
    return [f for f in result.findings if f.rule == "rl-rollout-oom"]


def judged(model, args, hardware="a100"):
    """The rule alone on the audit's context (the 8B shape makes a whole audit take seconds)."""
    return rollout_oom(AuditContext(model=model, args=args, hardware=resolve_hardware(hardware)))


def test_a_colocated_vllm_share_that_leaves_no_room_is_the_predicted_oom_and_the_share_offered_fits(tmp_path):
    model = lora_shaped_8b()
    colocated = dict(use_vllm=True, vllm_mode="colocate")
    (found,) = oom(nbguard.audit(model, args=grpo_config(tmp_path, **colocated, vllm_gpu_memory_utilization=0.9),
                                 hardware="a100"))
    evidence = found.evidence
    assert found.severity.value == "error"
    assert evidence["engine_bytes"] == int(0.9 * 40 * GIB) and evidence["fused"] is True
    assert evidence["parts"]["weights"] >= 14 * GIB and evidence["peak_gb"] > evidence["usable_gb"]
    assert "vLLM's share 36.0 GiB (vllm_gpu_memory_utilization=0.9" in found.detail
    share = evidence["fix"]["vllm_gpu_memory_utilization"]
    assert 0.4 < share < 0.9 and f"Set vllm_gpu_memory_utilization={share!r}" in found.detail
    # the share offered, applied: quiet; the engine on its own GPU (server mode): quiet
    assert judged(model, grpo_config(tmp_path, **colocated, vllm_gpu_memory_utilization=share)) is None
    assert judged(model, grpo_config(tmp_path, use_vllm=True, vllm_mode="server", vllm_gpu_memory_utilization=0.9)) \
        is None
    # with sleep mode the engine is freed for the step, but the wake-up still meets the resident training state
    asleep = judged(model, grpo_config(tmp_path, **colocated, vllm_gpu_memory_utilization=0.9,
                                       vllm_enable_sleep_mode=True))
    assert "when vLLM wakes" in asleep.title and asleep.evidence["sleep_mode"] is True
    fixed = asleep.evidence["fix"]["vllm_gpu_memory_utilization"]
    assert judged(model, grpo_config(tmp_path, **colocated, vllm_gpu_memory_utilization=fixed,
                                     vllm_enable_sleep_mode=True)) is None


# A GPU whose usable memory (90%) leaves ~0.8 GiB beside the 1 GiB CUDA context: the tiny model's logits over
# COMPLETION tokens take 2 copies x 2 bytes (bf16, GRPOConfig's default) x 128 vocabulary per token and row,
# so 4 rows do not fit and 2 do.
SMALL_GPU = Hardware("small", "a 2 GB GPU", "cuda", (8, 0), 2.0)
COMPLETION = 600_000


def unfused(trainer):
    """The trainer's model as TRL built it before its fused LM head: the model's own forward, full logits."""
    trainer.model.__dict__.pop("forward", None)
    return trainer


def test_full_logits_of_the_completion_length_are_the_predicted_oom_and_a_smaller_micro_batch_fits(tmp_path):
    trainer = unfused(grpo_trainer(tmp_path, max_completion_length=COMPLETION))
    (found,) = oom(nbguard.audit(trainer=trainer, hardware=SMALL_GPU))
    evidence = found.evidence
    assert evidence["fused"] is False and evidence["engine_bytes"] == 0
    assert evidence["logits_bytes"] == 4 * 2 * COMPLETION * 128 * 2
    assert f"4 rows x {COMPLETION} completion tokens x 128 vocabulary" in found.detail
    assert evidence["fix"] == {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2}
    assert "The generation batch and the optimizer's batch stay the same." in found.detail
    # the fix applied (the same 4 completions per generation, two micro-batches of 2): quiet
    fixed = unfused(grpo_trainer(tmp_path, max_completion_length=COMPLETION, **evidence["fix"]))
    assert oom(nbguard.audit(trainer=fixed, hardware=SMALL_GPU)) == []
    # the same trainer as TRL 1.16 builds it (fused LM head): no logits to count, quiet
    fused = grpo_trainer(tmp_path, max_completion_length=COMPLETION)
    assert oom(nbguard.audit(trainer=fused, hardware=SMALL_GPU)) == []
