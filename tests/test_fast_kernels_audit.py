"""fast-kernels-missing (issue 43 item 5): a model whose fast kernels are not importable runs pure-PyTorch layers.

Real models from their configs: a tiny Qwen3-Next (gated DeltaNet layers beside full attention) and a tiny
Mamba2, audited for an H100, on this machine, where flash-linear-attention, causal-conv1d and mamba-ssm are not
installed: transformers imported their modeling modules with the reference PyTorch functions, as it does on a
GPU machine without them. The twins are quiet: a Llama (no such layers) for the same GPU, and the same Qwen3-Next
for a CPU target, where the PyTorch path is the only one.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers import AutoModelForCausalLM, Mamba2Config

import nbguard
from nbguard.testing import tiny_llama

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(name) is not None for name in ("fla", "causal_conv1d", "mamba_ssm")),
    reason="the fast kernels are installed here: transformers took them")


def tiny_qwen3_next():
    from transformers import Qwen3NextConfig  # (here: the transformers 4.50 lane collects this file and has none)

    torch.manual_seed(0)
    config = Qwen3NextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, linear_num_value_heads=2, linear_num_key_heads=1, linear_key_head_dim=8,
        linear_value_head_dim=8, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, layer_types=["linear_attention", "full_attention"])
    return AutoModelForCausalLM.from_config(config)


def tiny_mamba2():
    torch.manual_seed(0)
    config = Mamba2Config(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_heads=4, head_dim=16,
                          state_size=8, n_groups=1, expand=2, chunk_size=8)
    return AutoModelForCausalLM.from_config(config)


def test_gated_deltanet_without_fla_and_causal_conv1d_is_flagged_for_a_gpu():
    model = tiny_qwen3_next()
    batch = {"input_ids": torch.randint(0, 64, (1, 8))}
    assert torch.isfinite(model(**batch).logits).all()  # the fallback runs, and is correct
    result = nbguard.audit(model, hardware="h100")
    (found,) = [f for f in result.findings if f.rule == "fast-kernels-missing"]
    assert found.severity.value == "warning"
    assert found.evidence["layers"] == ["Qwen3NextGatedDeltaNet"]
    assert found.evidence["install"] == ["causal-conv1d", "flash-linear-attention"]
    functions = {f["function"] for f in found.evidence["fallbacks"]}
    assert {"chunk_gated_delta_rule", "causal_conv1d_fn"} <= functions
    assert "pip install causal-conv1d flash-linear-attention" in found.detail and "transformers#48718" in found.detail

    # its twins are quiet: a Llama (no such layers) for the same GPU, the same model for a CPU target
    assert "fast-kernels-missing" not in nbguard.audit(tiny_llama(), hardware="h100").rules
    assert "fast-kernels-missing" not in nbguard.audit(model, hardware="cpu").rules


def test_mamba2_without_mamba_ssm_is_flagged():
    result = nbguard.audit(tiny_mamba2(), hardware="a100")
    (found,) = [f for f in result.findings if f.rule == "fast-kernels-missing"]
    assert "mamba-ssm" in found.evidence["install"] and found.evidence["layers"] == ["Mamba2Mixer"]
