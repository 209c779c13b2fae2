"""MXFP4 (gpt-oss) and cuDNN attention on Hopper: CUDA-only failures, tested on configuration, hardware profile
and the libraries' own validation code (no GPU: MXFP4 kernels need Triton on CUDA, cuDNN SDPA needs an NVIDIA GPU)."""
from __future__ import annotations

import pytest
import torch

import nbguard
from nbguard.explainer import diagnose
from nbguard.testing import tiny_batch, tiny_llama


def tiny_gpt_oss(quantization=None):
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    model = GptOssForCausalLM(GptOssConfig(
        vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, layer_types=["full_attention"]))
    if quantization is not None:
        # What from_pretrained leaves on a model it loaded in MXFP4 on a GPU: the config and the quantizer.
        from transformers.quantizers.quantizer_mxfp4 import Mxfp4HfQuantizer

        model.config.quantization_config = quantization
        model.hf_quantizer = Mxfp4HfQuantizer(quantization)
        model.is_quantized = True
    return model


def rule_findings(result, rule_id):
    return [f for f in result.findings if f.rule == rule_id]


def test_mxfp4_model_is_flagged_and_the_trainer_refuses_it(tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import Mxfp4Config, Trainer, TrainingArguments

    model = tiny_gpt_oss(Mxfp4Config())
    (f,) = rule_findings(nbguard.audit(model), "mxfp4-not-trainable")
    assert f.severity.value == "error" and f.evidence["bf16_weights_gb"] is not None
    peft = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"]))
    with pytest.raises(ValueError) as raised:  # transformers' own validation, LoRA included
        Trainer(model=peft, args=TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[]))
    assert diagnose(raised.value).signature == "mxfp4-not-trainable"


def test_dequantized_or_plain_gpt_oss_stays_quiet():
    from transformers import Mxfp4Config

    assert not rule_findings(nbguard.audit(tiny_gpt_oss(Mxfp4Config(dequantize=True))), "mxfp4-not-trainable")
    assert not rule_findings(nbguard.audit(tiny_gpt_oss()), "mxfp4-not-trainable")


def padded_batch():
    batch = tiny_batch(batch_size=2, seq_len=12)
    batch["attention_mask"][1, 8:] = 0
    return batch


def test_a_named_hopper_profile_is_noted_unchecked_never_warned():
    """The bug is tied to releases (finite on an H200 with torch 2.11): without the GPU to probe, no warning."""
    model = tiny_llama()
    assert model.config._attn_implementation == "sdpa" and torch.backends.cuda.cudnn_sdp_enabled()
    (f,) = rule_findings(nbguard.audit(model, batch=padded_batch(), hardware="h100"), "cudnn-attention-nan-hopper")
    assert f.severity.value == "info" and "not checked here" in f.title and f.fixes == []
    assert f.evidence["padding_seen"] is True and f.evidence["probe"] is None
    assert "not this machine's GPU" in f.detail


def test_the_probe_says_why_it_cannot_run_without_cuda():
    from nbguard.auditor.cudnn_probe import probe_cudnn_sdpa_backward

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: test_cudnn_probe_on_this_gpu runs the probe")
    probe = probe_cudnn_sdpa_backward(64, torch.bfloat16)
    assert probe.reproduced is None and probe.reason == "no CUDA device on this machine"


@pytest.mark.cuda
def test_cudnn_probe_on_this_gpu():
    """On a real GPU the probe runs the cuDNN backend forced, at the model's head dim, and the rule follows it."""
    from nbguard.auditor.cudnn_probe import probe_cudnn_sdpa_backward

    probe = probe_cudnn_sdpa_backward(64, torch.bfloat16)
    assert probe.reproduced in (True, False) or probe.reason.startswith("the cuDNN backend did not run")
    model = tiny_llama().cuda()
    found = rule_findings(nbguard.audit(model, batch={k: v.cuda() for k, v in padded_batch().items()}),
                          "cudnn-attention-nan-hopper")
    if torch.cuda.get_device_capability() != (9, 0) or probe.reproduced is False:
        assert found == []
    elif probe.reproduced:
        assert found[0].severity.value == "warning" and found[0].fixes == ["disable-cudnn-sdp"]


def test_other_gpus_unpadded_batches_and_cudnn_off_stay_quiet():
    model = tiny_llama()
    assert not rule_findings(nbguard.audit(model, batch=padded_batch(), hardware="a100"), "cudnn-attention-nan-hopper")
    assert not rule_findings(nbguard.audit(model, batch=tiny_batch(batch_size=2, seq_len=12), hardware="h100"),
                             "cudnn-attention-nan-hopper")
    result = nbguard.fixes.apply("disable-cudnn-sdp", model=model)
    try:
        assert result.changed and not torch.backends.cuda.cudnn_sdp_enabled()
        assert not rule_findings(nbguard.audit(model, batch=padded_batch(), hardware="h100"),
                                 "cudnn-attention-nan-hopper")
    finally:
        torch.backends.cuda.enable_cudnn_sdp(True)


def test_cudnn_backward_nan_message_gets_its_own_signature():
    # Message only: anomaly mode names this backward function on CUDA builds (pytorch#139298).
    exc = RuntimeError("Function 'ScaledDotProductCudnnAttentionBackward0' returned nan values in its 0th output.")
    diagnosis = diagnose(exc)
    assert diagnosis.signature == "cudnn-attention-backward-nan" and diagnosis.fixes == ["disable-cudnn-sdp"]
    other = diagnose(RuntimeError("Function 'MulBackward0' returned nan values in its 0th output."))
    assert other.signature == "anomaly-nan-output"
