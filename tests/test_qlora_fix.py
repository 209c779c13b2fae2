"""switch-precision on real bitsandbytes 4-bit models (issue 12 section 1): every Linear4bit moves
to a compute dtype the target precision accepts, nothing is dequantised, the config follows, the
cell does the same, and the re-audit shows the compute dtype as it really is."""
from __future__ import annotations

import torch
from audit_helpers import make_args, make_trainer
from qlora_helpers import q_proj, qlora, scale_4bit
from watch_helpers import batches

import nbguard
import nbguard.fixes
from nbguard.introspect.quantization import read_quantization

torch.set_num_threads(1)


def _storage(model):
    return {n: (p.data.dtype, p.data.data_ptr(), p.data.numel())
            for n, p in model.named_parameters() if type(p).__name__ == "Params4bit"}


def test_switch_precision_moves_every_4bit_layer_and_never_dequantises(tmp_path):
    model = qlora("gemma3", prepare=True)
    trainer = make_trainer(model, make_args(tmp_path, fp16=False))
    before = nbguard.audit(trainer=trainer, hardware="t4")
    assert before.finding("bnb-compute-dtype").severity == "error"
    storage = _storage(model)
    result = nbguard.fixes.apply("switch-precision", trainer=trainer, **before.fix_options("switch-precision"))
    compute = result.changed["4bit_compute_dtype"]
    layers = [k for k in compute if not k.startswith("config.")]
    assert len(layers) == 14 and len([k for k in layers if k.endswith(".base_layer")]) == 4  # LoRA-wrapped or not
    assert compute["config.quantization_config.bnb_4bit_compute_dtype"] == "float16 -> float32"
    assert _storage(model) == storage  # the same 4-bit tensors: nothing dequantised or copied
    facts = read_quantization(model, model.config.quantization_config)
    assert facts.compute_dtype_set == {torch.float32} and facts.config_compute_dtype == torch.float32
    after = nbguard.audit(trainer=trainer, hardware="t4")
    assert "bnb-compute-dtype" not in after
    assert after.stack["quantization"]["compute_dtypes"] == {"float32": 14}
    assert nbguard.fixes.apply("switch-precision", trainer=trainer, to="fp32").changed == {}  # idempotent
    trainer.train()  # and it trains


def test_the_cell_does_what_apply_does_and_says_how_to_reload():
    model = qlora(prepare=True)
    cell = nbguard.fixes.code("switch-precision", model="model", to="bf16")
    assert "bnb_4bit_compute_dtype=torch.bfloat16" in cell and "BitsAndBytesConfig" in cell
    storage = _storage(model)
    exec(cell, {"model": model})
    assert read_quantization(model).compute_dtype_set == {torch.bfloat16}
    assert model.config.quantization_config.bnb_4bit_compute_dtype == torch.bfloat16
    assert _storage(model) == storage


def test_an_overflow_in_fp16_4bit_compute_of_an_fp32_model_is_gone_after_the_fix():
    """The mechanism: the model is float32 everywhere else, yet the 4-bit matmul runs in fp16."""
    model = qlora(prepare=True)
    assert {p.dtype for p in model.parameters() if p.is_floating_point()} == {torch.float32}
    data = batches(1)[0]
    base = q_proj(model).base_layer
    seen = []
    handle = base.register_forward_hook(lambda m, a, out: seen.append(out.detach().abs().max().item()))
    with torch.no_grad():
        model(**data)
    scale_4bit(base, 2e5 / seen[-1])  # outputs of ~2e5: fine in fp32, inf in fp16
    with torch.no_grad():
        assert not torch.isfinite(model(**data).loss)
        assert seen[-1] == float("inf")
    nbguard.fixes.apply("switch-precision", model=model, to="fp32")
    with torch.no_grad():
        assert torch.isfinite(model(**data).loss)
        assert 1e5 < seen[-1] < 1e6
    handle.remove()
