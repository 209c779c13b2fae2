"""The quantised dry pass (rule quantized-dry-pass-nonfinite) on real torchao layers (pytorch/ao#3356).

torchao is its own extra (pyproject's `quant`, pinned in constraints/main.txt) with its own venv (make
test-quant, the tests marked quant): transformers imports torchao at every model import wherever it is
installed, so the other lanes leave it out; where it is absent this file skips.
"""
from __future__ import annotations

import random

import numpy
import pytest
import torch
from report_helpers import _first_nonfinite

pytest.importorskip("torchao", reason="torchao is installed in the main lane only (pyproject extra 'quant')")
import torchao.quantization.quant_api as quant_api  # noqa: E402
from torchao.float8 import convert_to_float8_training
from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

import nbguard
import nbguard.fixes
from nbguard.auditor import AuditContext
from nbguard.auditor.rules.quantized_dry_pass import RULE, quantized_dry_pass_nonfinite
from nbguard.introspect.quantized_layers import quant_method, read_quantized_layers
from nbguard.testing import tiny_batch, tiny_llama

torch.set_num_threads(1)
pytestmark = pytest.mark.quant


@pytest.fixture
def float8_on_cpu(monkeypatch):
    """quantize_ with a float8 config refuses unless CUDA cc >= 8.9 (quant_api._check_hardware_support); the
    Float8Tensor math itself (quantise, scaled matmul) runs on CPU. Only that hardware gate is lifted here, so
    the real per-row quantisation of pytorch/ao#3356 runs on this machine."""
    monkeypatch.setattr(quant_api, "_check_hardware_support", lambda granularities: None)


def float8_llama(lb=None):
    model = tiny_llama(dtype=torch.bfloat16)
    kwargs = {} if lb is None else {"activation_value_lb": lb}
    quantize_(model, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(), **kwargs))
    return model


def first_nonfinite_module(model, batch) -> str | None:
    """Independently of nbguard: the first module, in execution order, whose output holds NaN/Inf."""
    origin = _first_nonfinite(model, batch)
    return origin.module if origin is not None else None


def run_rule(model, batch=None):
    found = quantized_dry_pass_nonfinite(AuditContext(model=model, batch=batch))
    return [] if found is None else [found]


def test_tiny_llama_pad_row_is_zero():
    model = tiny_llama(dtype=torch.bfloat16)
    emb = model.get_input_embeddings()
    assert emb.padding_idx == model.config.pad_token_id == 0
    assert torch.count_nonzero(emb.weight[0]) == 0


def test_detects_torchao_float8_tensor_layers(float8_on_cpu):
    layers = read_quantized_layers(float8_llama())
    q = layers.find("model.layers.0.self_attn.q_proj")
    assert q is not None and q.kind == "torchao-tensor" and q.cls == "Float8Tensor"
    assert q.granularity == "per-row" and q.activation_value_lb is None and q.per_row_unbounded
    assert q.describe() == "torchao Float8Tensor per-row, activation_value_lb None"
    assert len(layers.layers) == 2 * 7 + 1  # q/k/v/o and gate/up/down in each of 2 layers, and lm_head
    bounded = read_quantized_layers(float8_llama(lb=1e-12)).find("model.layers.0.self_attn.q_proj")
    assert bounded.activation_value_lb == 1e-12 and not bounded.per_row_unbounded


def test_detects_float8_training_layers():
    model = tiny_llama(dtype=torch.bfloat16)
    convert_to_float8_training(model.model)
    layers = read_quantized_layers(model)
    q = layers.find("model.layers.0.self_attn.q_proj")
    assert q is not None and q.kind == "torchao-float8-training" and q.cls == "Float8Linear"
    assert q.granularity == "per-tensor" and not q.per_row_unbounded


def test_quant_method_of_gptq_and_awq_configs():
    # GPTQ/AWQ layers need their libraries and a GPU to build; the config's quant_method is read as given
    assert quant_method({"quant_method": "gptq", "bits": 4}) == "gptq"
    assert quant_method({"quant_method": "awq"}) == "awq"
    assert read_quantized_layers(tiny_llama(), {"quant_method": "awq"}).any
    assert not read_quantized_layers(tiny_llama()).any


def test_per_row_float8_names_the_first_projection(float8_on_cpu):
    model = float8_llama()
    batch = tiny_batch(pad_rows=1)
    expected = first_nonfinite_module(model, batch)
    assert expected == "model.layers.0.self_attn.q_proj"  # measured: the first projection reading the zero rows
    [found] = run_rule(model, batch)
    assert found.rule == RULE and found.severity.value == "error"
    assert found.evidence["module"] == expected and found.evidence["phase"] == "forward"
    assert found.evidence["quantization"] == "torchao Float8Tensor per-row, activation_value_lb None"
    assert found.evidence["padded_rows"] == [1] and found.evidence["batch_source"] == "batch"
    assert "amax 0 and scale 0" in found.detail and "activation_value_lb=1e-12" in found.detail
    assert found.fixes == ["float8-activation-lb"]


def test_builds_a_padded_batch_when_none_is_given(float8_on_cpu):
    model = float8_llama()
    [found] = run_rule(model)  # no batch, no trainer: two rows, the second half-padded with the config's pad id
    assert found.evidence["module"] == "model.layers.0.self_attn.q_proj"
    assert found.evidence["padded_rows"] == [1] and found.evidence["batch_source"].startswith("built")
    unpadded = tiny_batch()  # a batch without padding is not the one that shows it: a padded one is built
    [found] = run_rule(model, unpadded)
    assert found.evidence["batch_source"].startswith("built")


def test_through_nbguard_audit(float8_on_cpu):
    result = nbguard.audit(model=float8_llama(), batch=tiny_batch(pad_rows=1))
    [found] = [f for f in result.findings if f.rule == RULE]
    assert found.evidence["module"] == "model.layers.0.self_attn.q_proj"
    # the other rules read the Float8Tensor weights as quantised storage: none raises on them (the
    # quantised lm_head once broke zero-embedding-rows, whose storage walk a tensor subclass refuses)
    assert [f for f in result.findings if f.rule == "rule-error"] == []


def test_activation_value_lb_is_quiet_about_nonfinite(float8_on_cpu):
    model = float8_llama(lb=1e-12)
    batch = tiny_batch(pad_rows=1)
    assert first_nonfinite_module(model, batch) is None
    found = run_rule(model, batch)
    # no NaN; what is left on this CPU is the backward: torch has no derivative for the _scaled_mm that
    # quantize_'s inference weights run, and the rule says so as a warning rather than naming a NaN
    assert all(f.severity.value == "warning" and "exception" in f.evidence for f in found)
    assert all("module" not in f.evidence for f in found)
    if not torch.cuda.is_available():  # measured on CPU: the one finding is the backward's exception
        [warning] = found
        assert "derivative for aten::_scaled_mm is not implemented" in warning.evidence["exception"]


def test_float8_training_conversion_is_quiet():
    model = tiny_llama(dtype=torch.bfloat16)
    convert_to_float8_training(model.model)
    assert run_rule(model, tiny_batch(pad_rows=1)) == []


def test_fix_bounds_the_scale_and_the_dry_pass_turns_quiet(float8_on_cpu):
    model = float8_llama()
    batch = tiny_batch(pad_rows=1)
    changed = nbguard.fixes.apply("float8-activation-lb", model=model)
    assert changed and all(v == "None -> 1e-12" for v in changed.changed.values())
    assert "model.layers.0.self_attn.q_proj.weight.act_quant_kwargs.hp_value_lb" in changed.changed
    assert not nbguard.fixes.apply("float8-activation-lb", model=model).changed  # idempotent
    assert first_nonfinite_module(model, batch) is None
    assert all(f.severity.value != "error" for f in run_rule(model, batch))
    assert read_quantized_layers(model).find("model.layers.0.self_attn.q_proj").activation_value_lb == 1e-12


def test_fix_cell_does_the_same(float8_on_cpu):
    model = float8_llama()
    cell = nbguard.fixes.code("float8-activation-lb", model="my_model")
    assert "activation_value_lb=1e-12" in cell and "my_model.modules()" in cell
    exec(cell, {"my_model": model})  # noqa: S102  (the cell a user would run)
    assert first_nonfinite_module(model, tiny_batch(pad_rows=1)) is None
    assert all(f.severity.value != "error" for f in run_rule(model, tiny_batch(pad_rows=1)))


def _state(model):
    plain = {n: p.detach().clone() for n, p in model.named_parameters() if type(p) is torch.nn.Parameter}
    quantized = {n: (p.qdata.clone(), p.scale.clone(), p.act_quant_kwargs)
                 for n, p in model.named_parameters() if hasattr(p, "qdata")}
    grads = {n: p.grad for n, p in model.named_parameters()}
    modes = {n: m.training for n, m in model.named_modules()}
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in model.modules())
    return plain, quantized, grads, modes, hooks


@pytest.mark.parametrize("build", ["float8", "training"])
def test_leaves_no_trace(float8_on_cpu, build):
    if build == "float8":
        model = float8_llama()
    else:
        model = tiny_llama(dtype=torch.bfloat16)
        convert_to_float8_training(model.model)
    model.eval()
    model.model.layers[1].train()  # a mixed mode must come back as it was, module by module
    norm = model.model.norm.weight
    norm.grad = torch.full_like(norm, 0.5)
    before = _state(model)
    torch.manual_seed(123)
    random.seed(123)
    numpy.random.seed(123)
    rng = (torch.get_rng_state(), random.getstate(), numpy.random.get_state()[1].copy())
    run_rule(model, tiny_batch(pad_rows=1))
    plain, quantized, grads, modes, hooks = _state(model)
    assert all(torch.equal(plain[n], t) for n, t in before[0].items())
    for n, (qdata, scale, act) in before[1].items():
        assert torch.equal(quantized[n][0].float(), qdata.float()) and torch.equal(quantized[n][1], scale)
        assert quantized[n][2] is act
    assert all(grads[n] is g for n, g in before[2].items())
    assert norm.grad is before[2]["model.norm.weight"] and torch.all(norm.grad == 0.5)
    assert modes == before[3] and hooks == before[4]
    assert torch.equal(torch.get_rng_state(), rng[0]) and random.getstate() == rng[1]
    assert numpy.array_equal(numpy.random.get_state()[1], rng[2])


def test_verify_says_why_the_fix_is_not_run_on_a_step(float8_on_cpu):
    result = nbguard.audit(model=float8_llama(), batch=tiny_batch(pad_rows=1), verify=True)
    assert [f.rule for f in result.findings if f.rule == RULE] == [RULE]
    if not torch.cuda.is_available():  # the step verify captures runs a backward torch cannot take on CPU
        [error] = [f for f in result.findings if f.rule == "verify-error"]
        assert "derivative for aten::_scaled_mm is not implemented" in error.evidence["exception"]


def test_lora_on_float8_names_the_base_layer(float8_on_cpu):
    """The case of pytorch/ao#3356: LoRA adapters on a per-row float8 model (PEFT wraps each Float8Tensor Linear)."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(float8_llama(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    batch = tiny_batch(pad_rows=1)
    expected = first_nonfinite_module(model, batch)
    assert expected == "base_model.model.model.layers.0.self_attn.q_proj.base_layer"
    [found] = run_rule(model, batch)
    assert found.evidence["module"] == expected
    assert found.evidence["quantization"] == "torchao Float8Tensor per-row, activation_value_lb None"
    assert found.fixes == ["float8-activation-lb"]
    nbguard.fixes.apply("float8-activation-lb", model=model)
    assert first_nonfinite_module(model, batch) is None


class PaddedRows(torch.utils.data.Dataset):
    """Eight rows of 16 tokens, the last two padding only (attention_mask 0, labels -100)."""

    def __init__(self):
        batch = tiny_batch(8, 16, pad_rows=2)
        self.rows = [{k: v[i] for k, v in batch.items()} for i in range(8)]

    def __len__(self):
        return 8

    def __getitem__(self, index):
        return self.rows[index]


def test_takes_the_trainers_padded_batch(float8_on_cpu, tmp_path):
    from audit_helpers import make_args
    from transformers import Trainer

    trainer = Trainer(model=float8_llama(), args=make_args(tmp_path), train_dataset=PaddedRows())
    found = quantized_dry_pass_nonfinite(AuditContext(model=trainer.model, trainer=trainer, args=trainer.args))
    assert found.evidence["batch_source"] == "trainer" and found.evidence["padded_rows"]
    assert found.evidence["module"] == "model.layers.0.self_attn.q_proj"
