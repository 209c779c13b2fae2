"""Issue 43 item 6: FSDP over a QLoRA model whose 4-bit codes are stored in uint8 (bitsandbytes' default) fails,
and the audit says so before the wrap, with the storage dtype that works (accelerate#3983).

Real objects on the CPU: a tiny Llama quantised by bitsandbytes (real Linear4bit layers), PEFT LoRA on it,
and torch's FSDP1 wrap in a one-rank gloo process group. What is reproduced: FSDP1 refusing the uint8 codes
beside bf16 weights, and the bf16-stored twin wrapping, running forward and backward with finite gradients.
FSDP2's loss 0 / NaN gradients on GPUs (the issue's symptom) is not run here.
"""
from __future__ import annotations

import tempfile

import pytest
import torch
from audit_helpers import make_args

import nbguard
from nbguard.testing import tiny_llama

pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")


def qlora_stored_in(storage: torch.dtype):
    """A tiny Llama reloaded in 4-bit with its codes stored in ``storage`` and its other weights in bf16 (the
    FSDP-QLoRA recipe, bar the storage), LoRA adapters in bf16 too."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16,
                                bnb_4bit_quant_storage=storage)
    with tempfile.TemporaryDirectory(prefix="nbguard-fsdp-4bit-") as path:
        tiny_llama(seed=0).save_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, quantization_config=config, device_map="cpu",
                                                     dtype=torch.bfloat16)
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    return get_peft_model(model, lora, autocast_adapter_dtype=False)


@pytest.fixture
def one_rank(tmp_path):
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def fsdp_wrap(model):
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision

    bf16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)
    return FullyShardedDataParallel(model, use_orig_params=True, device_id=torch.device("cpu"), mixed_precision=bf16)


def storage_findings(result):
    return [f for f in result.findings if f.rule == "bnb-fsdp-quant-storage"]


def test_uint8_quant_storage_under_fsdp_is_named_before_the_wrap_fails_and_the_storage_offered_wraps(
        tmp_path, one_rank):
    fsdp_args = make_args(tmp_path, bf16=True, fsdp=True)
    model = qlora_stored_in(torch.uint8)
    (found,) = storage_findings(nbguard.audit(model, args=fsdp_args, hardware="a100"))
    assert found.severity.value == "error"
    assert found.evidence["quant_storage"] == {"uint8": 14} and found.evidence["fsdp"] == "args.fsdp"
    assert found.evidence["fix"] == {"bnb_4bit_quant_storage": "bfloat16", "dtype": "bfloat16"}
    assert "bnb_4bit_quant_storage=torch.bfloat16" in found.detail and "accelerate#3983" in found.detail
    # what the audit predicts: the real FSDP wrap refuses the uint8 codes
    with pytest.raises(ValueError, match="flatten"):
        fsdp_wrap(model)
    # its healthy twin, the same model without FSDP: quiet
    assert storage_findings(nbguard.audit(model, args=make_args(tmp_path, bf16=True), hardware="a100")) == []
    # the fix applied: codes stored in bf16. The audit is quiet, and FSDP wraps, runs and gets finite gradients
    fixed = qlora_stored_in(getattr(torch, found.evidence["fix"]["bnb_4bit_quant_storage"]))
    assert storage_findings(nbguard.audit(fixed, args=fsdp_args, hardware="a100")) == []
    wrapped = fsdp_wrap(fixed)
    ids = torch.randint(3, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    loss = wrapped(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = [p.grad for p in wrapped.parameters() if p.grad is not None]
    assert torch.isfinite(loss) and loss.item() > 0 and grads and all(torch.isfinite(g).all() for g in grads)
    # the wrapped model itself, audited without FSDP args: FSDP is read off the model, and quiet
    assert storage_findings(nbguard.audit(wrapped, args=make_args(tmp_path, bf16=True), hardware="a100")) == []
