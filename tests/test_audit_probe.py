"""The activation probe measures every module and leaves the model exactly as it was."""
from __future__ import annotations

import math

import torch
from audit_helpers import healthy_peft_model, state_copy

import nbguard
from nbguard.auditor import run_probe
from nbguard.testing import tiny_batch, tiny_gemma3, tiny_llama


def _hook_counts(model):
    return [(len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks)) for m in model.modules()]


def test_probe_leaves_model_exactly_as_it_was():
    model = healthy_peft_model()
    model.train()
    model.base_model.model.model.layers[0].eval()  # a mixed mode must survive, module by module
    trainable = [p for p in model.parameters() if p.requires_grad]
    old_grad = torch.full_like(trainable[0], 3.0)
    trainable[0].grad = old_grad
    modes = [m.training for m in model.modules()]
    hooks = _hook_counts(model)
    before = state_copy(model)

    result = run_probe(model, tiny_batch(2, 8))

    assert result.backward and result.loss is not None and math.isfinite(result.loss)
    assert [m.training for m in model.modules()] == modes
    assert _hook_counts(model) == hooks
    assert trainable[0].grad is old_grad and torch.equal(old_grad, torch.full_like(old_grad, 3.0))
    assert all(p.grad is None for p in trainable[1:])
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


def test_probe_records_every_module_with_headroom():
    model = tiny_gemma3()
    result = run_probe(model)  # synthetic batch
    assert result.synthetic_batch
    names = {m.module for m in result.modules}
    assert {"model.layers.0.mlp.down_proj", "model.norm", "lm_head"} <= names
    for m in result.modules:
        peak = max(m.absmax, m.input_absmax)
        assert m.absmax >= 0 and (m.headroom is None or math.isclose(m.headroom, 65504.0 / peak))
    assert result.near_limit() == []
    doc = result.to_dict()
    assert doc["limit"] == 65504.0 and len(doc["modules"]) == len(result.modules)


def test_probe_without_trainable_parameters_does_no_backward():
    model = tiny_llama()
    for p in model.parameters():
        p.requires_grad_(False)
    result = run_probe(model, tiny_batch(1, 8))
    assert not result.backward and all(p.grad is None for p in model.parameters())


def test_probe_names_non_finite_outputs_as_past_the_limit():
    model = tiny_llama()
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[0, 0] = float("inf")
    near = {m["module"] for m in run_probe(model, tiny_batch(1, 8)).near_limit()}
    assert "model.layers.0.mlp.up_proj" in near


def test_probe_on_a_meta_model_is_reported_not_raised():
    result = nbguard.audit(tiny_llama().to("meta"), probe=True, hardware="a100")
    assert result.probe is None
    assert "meta device" in result.finding("probe-error").detail


def test_probe_sees_an_overflow_born_between_two_children():
    """act(gate) * up inside LlamaMLP passes 65504 while every child's output stays far below it."""
    model = tiny_llama()
    mlp = model.model.layers[1].mlp
    with torch.no_grad():
        mlp.gate_proj.weight.mul_(600)
        mlp.up_proj.weight.mul_(600)
    result = run_probe(model, tiny_batch(2, 16))
    by_name = {m.module: m for m in result.modules}
    prefix = "model.layers.1.mlp"
    assert all(by_name[f"{prefix}.{child}"].absmax < 65504 / 2 for child in ("gate_proj", "up_proj", "down_proj"))
    assert by_name[f"{prefix}.down_proj"].input_absmax > 65504
    near = {m["module"]: m for m in result.near_limit()}
    assert f"{prefix}.down_proj" in near and near[f"{prefix}.down_proj"]["headroom"] < 1
    finding = nbguard.audit(model, batch=tiny_batch(2, 16), hardware="t4", probe=True).finding("fp16-overflow-risk")
    assert finding is not None
    assert f"{prefix}.down_proj" in [m["module"] for m in finding.evidence["modules_near_limit"]["first"]]
