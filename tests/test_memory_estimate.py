"""Issue 12 section 5: the memory estimate behind switch-precision, on meta-device models of the
shapes users fine-tune (Llama 3.2 1B, Gemma 3 4B's language model, Llama 3 8B): no weight memory."""
from __future__ import annotations

import copy

import pytest
import torch
from audit_helpers import make_args
from watch_helpers import batches, scale_output_to, train

import nbguard
import nbguard.fixes
from nbguard.auditor.memory import GIB, RESERVE_BYTES, bf16_gpus_that_fit, estimate_memory
from nbguard.hardware import Hardware, resolve_hardware
from nbguard.testing import meta_llama_8b, tiny_llama


def _meta(config_cls, model_cls, dtype=torch.float16, **shape):
    with torch.device("meta"):
        model = model_cls(config_cls(**shape))
    return model.to(dtype)


def llama_1b(dtype=torch.float16):
    from transformers import LlamaConfig, LlamaForCausalLM

    return _meta(LlamaConfig, LlamaForCausalLM, dtype, vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                 num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True)


def gemma3_4b(dtype=torch.float16):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    return _meta(Gemma3TextConfig, Gemma3ForCausalLM, dtype, vocab_size=262208, hidden_size=2560,
                 intermediate_size=10240, num_hidden_layers=34, num_attention_heads=8, num_key_value_heads=4,
                 head_dim=256)


def llama_8b(dtype=torch.float16):
    return meta_llama_8b().to(dtype)


def _llama_count(v, h, i, layers, heads, kv, tied):
    hd = h // heads
    per_layer = h * heads * hd + 2 * h * kv * hd + heads * hd * h + 3 * h * i + 2 * h
    return v * h * (1 if tied else 2) + layers * per_layer + h


def _gemma3_count(v=262208, h=2560, i=10240, layers=34, heads=8, kv=4, hd=256):
    per_layer = h * heads * hd + 2 * h * kv * hd + heads * hd * h + 2 * hd + 3 * h * i + 4 * h
    return v * h + layers * per_layer + h  # tied embeddings


def _lora_like(model, names=("q_proj", "v_proj")):
    """Frozen base, a few trainable projections (what LoRA's trainable share looks like in memory)."""
    for n, p in model.named_parameters():
        p.requires_grad = any(k in n for k in names) and "layers.0." in n
    return model


@pytest.mark.parametrize("build, count", [
    (llama_1b, _llama_count(128256, 2048, 8192, 16, 32, 8, tied=True)),
    (gemma3_4b, _gemma3_count()),
    (llama_8b, _llama_count(128256, 4096, 14336, 32, 32, 8, tied=False)),
])
def test_counts_and_bytes_follow_the_shapes(build, count):
    model = build()
    assert all(p.is_meta for p in model.parameters())
    full = estimate_memory(model, "fp32")
    assert full.parameters == count and full.trainable == count
    assert full.weights_bytes == 4 * count and full.grads_bytes == 4 * count and full.optimizer_bytes == 8 * count
    assert full.total_bytes == 16 * count + RESERVE_BYTES
    frozen = estimate_memory(_lora_like(model), "as-is")
    assert frozen.trainable < count // 100
    assert frozen.weights_bytes == 2 * count  # all fp16 as loaded
    assert estimate_memory(model, "bf16").weights_bytes == 2 * (count - frozen.trainable) + 4 * frozen.trainable


def test_known_model_sizes():
    """The public parameter counts of Llama 3.2 1B and Llama 3 8B."""
    assert estimate_memory(llama_1b()).parameters == 1_235_814_400
    assert estimate_memory(meta_llama_8b()).parameters == 8_030_261_248


@pytest.mark.parametrize("build, gpu, fits_fp32", [
    (llama_1b, "t4", True),  # 1.2B frozen in fp32: ~5.6 GiB
    (gemma3_4b, "t4", False),  # ~4.3B: ~17 GiB in fp32, a T4 has 15 GB
    (gemma3_4b, "l4", True),
    (llama_8b, "t4", False),
    (llama_8b, "a10g", False),
    (llama_8b, "a100", True),  # ~31 GiB of 40
])
def test_fp32_fits_or_not(build, gpu, fits_fp32):
    model = _lora_like(build())
    hw = resolve_hardware(gpu)
    assert estimate_memory(model, "fp32").fits(hw.memory_gb) is fits_fp32
    assert estimate_memory(model, "fp32").fits(None) is None  # CPU / unknown memory: no verdict


def test_partial_fp32_counts_only_the_named_modules():
    model = _lora_like(llama_8b())
    base = estimate_memory(model, "as-is")
    mlp = model.model.layers[3].mlp
    n = sum(p.numel() for p in mlp.parameters())
    partial = estimate_memory(model, "as-is", fp32_modules={"model.layers.3.mlp"})
    assert partial.weights_bytes - base.weights_bytes == 2 * n
    assert partial.fits(resolve_hardware("t4").memory_gb) is False  # 8B in fp16 is 16 GB already
    assert estimate_memory(_lora_like(llama_1b()), "as-is", fp32_modules={"model.layers.3.mlp"}).fits(15.0)


def test_bf16_gpus_that_fit_the_8b_and_errors():
    gpus = bf16_gpus_that_fit(_lora_like(llama_8b()))
    assert gpus[0] == "l4" and "a100" in gpus and "t4" not in gpus and "v100" not in gpus
    assert 16 * GIB < estimate_memory(_lora_like(llama_8b()), "bf16").total_bytes < 18 * GIB
    with pytest.raises(ValueError, match="precision must be one of"):
        estimate_memory(llama_1b(), "fp8")


# ---- what switch-precision offers when fp32 does not fit ------------------------------------------
def test_the_audit_offers_the_partial_variant_when_fp32_does_not_fit_and_shows_the_estimate(tmp_path):
    model = _lora_like(gemma3_4b())  # fp16, a family that overflows fp16
    result = nbguard.audit(model, args=make_args(tmp_path, fp16=True), hardware="t4")
    f = result.finding("fp16-overflow-risk")
    memory = f.evidence["memory"]
    assert memory["fits"] is False and memory["fp32_gb"] > 15 and memory["memory_gb"] == 15.0
    assert memory["bf16_gpus"][0] == "l4" and memory["partial_fp32_gb"] < 10
    assert result.stack["memory"]["offer"] == {"to": "fp32", "only": []}  # no probe on meta: no layer named
    assert result.fix_options("switch-precision") == {"to": "fp32", "only": []}
    cell = result.to_document()["fix_cells"]["switch-precision"]["code"]
    assert "_fp32_layers = []" in cell and "bf16-capable GPU" in cell
    # the same model fits an A100 in fp32: the full switch as always, no memory note
    big = nbguard.audit(model, args=make_args(tmp_path, fp16=True), hardware="a100")
    assert big.fix_options("switch-precision") == {"to": "bf16"} and "memory" not in big.finding(
        "fp16-overflow-risk").evidence
    assert big.stack["memory"]["target_fits"] is True


def test_the_partial_variant_runs_only_the_overflowing_layers_in_fp32_and_training_is_finite(tmp_path):
    """A tiny model audited against a GPU too small for it in fp32 (memory between the two): the probe
    names the MLP whose product overflows; the offered fix makes that MLP fp32 and nothing else."""
    model = tiny_llama()
    data = batches(3)
    scale_output_to(model, model.model.layers[1].mlp.up_proj, data[0], 2e5)
    model.half()
    for n, p in model.named_parameters():
        p.requires_grad = "layers.1" in n
    # a T4-like GPU whose memory lies between what this model needs as it is and in full fp32
    between = (estimate_memory(model, "as-is").total_bytes + estimate_memory(model, "fp32").total_bytes) / 2
    small_t4 = Hardware("t4", "NVIDIA Tesla T4 (small)", "cuda", (7, 5), between / 0.9 / GIB)
    pristine = copy.deepcopy(model)
    result = nbguard.audit(model, args=make_args(tmp_path, fp16=True), batch=data[0], probe=True, hardware=small_t4)
    options = result.fix_options("switch-precision")
    assert options == {"to": "fp32", "only": ["model.layers.1.mlp"]}
    assert result.stack["memory"]["partial_fits"] is True and result.stack["memory"]["target_fits"] is False
    with torch.autocast("cpu", dtype=torch.float16), torch.no_grad():
        assert not torch.isfinite(model(**data[0]).loss)  # the overflow, before
    changed = nbguard.fixes.apply("switch-precision", model=model, **options).changed
    assert changed["scope"] == "partial" and changed["model.layers.1.mlp.forward"].startswith("runs in float32")
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert dtypes["model.layers.1.mlp.up_proj.weight"] == torch.float32
    assert dtypes["model.layers.0.mlp.up_proj.weight"] == torch.float16  # the rest stays as it was
    assert dtypes["model.layers.1.self_attn.q_proj.weight"] == torch.float32  # trainable: fp32 for the scaler
    assert nbguard.fixes.apply("switch-precision", model=model, **options).changed == {}  # idempotent
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    losses = train(model, opt, data, scaler=scaler, autocast=torch.float16)
    assert all(torch.isfinite(x) for x in losses)
    # the cell does the same on the untouched copy
    exec(nbguard.fixes.code("switch-precision", model="m", **options), {"m": pristine})
    with torch.autocast("cpu", dtype=torch.float16), torch.no_grad():
        assert torch.isfinite(pristine(**data[0]).loss)
    assert pristine.model.layers[0].mlp.up_proj.weight.dtype == torch.float16


def test_only_names_must_be_modules():
    with pytest.raises(ValueError, match="is not a module of the model"):
        nbguard.fixes.apply("switch-precision", model=tiny_llama(), to="fp32", only=["model.layers.9"])
    with pytest.raises(ValueError, match="only must be a list of module names"):
        nbguard.fixes.code("switch-precision", model="m", only="model.layers.0")


def test_a_fact_that_cannot_be_read_is_an_info_finding_and_the_audit_goes_on(tmp_path):
    model = tiny_llama()
    model.config.update({"unsloth_version": "2026.10.9"})  # an Unsloth marker: those facts are read too

    class Unreadable:  # a quantization_config whose attributes raise, as a broken remote config can
        def __getattr__(self, name):
            raise RuntimeError(f"broken config attribute {name}")

    model.config.quantization_config = Unreadable()
    result = nbguard.audit(model, args=make_args(tmp_path, fp16=True), hardware="t4")
    failed = result.finding("facts-error")
    assert failed is not None and failed.severity == "info" and failed.evidence["facts"] == "quantization"
    assert "broken config attribute" in failed.detail
    assert "unsloth" in result.stack and "memory" in result.stack  # the other facts were still read
