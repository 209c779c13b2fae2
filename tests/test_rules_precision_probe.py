"""Issue 13 item 7: the probe reads gradient magnitudes too, so overflows that happen only in backward are predicted."""
from __future__ import annotations

import torch
from audit_helpers import make_args

import nbguard
from nbguard.auditor.probe import FP16_MAX, run_probe
from nbguard.findings import Severity
from nbguard.testing import tiny_batch, tiny_llama

ANSWER = 7  # the one supervised token: a single-token answer, as in classification fine-tuning


def answer_batch():
    batch = tiny_batch(1, 16)
    batch["labels"][:] = -100
    batch["labels"][0, -1] = ANSWER
    return batch


def backward_only_overflow():
    """A model whose forward fits fp16 but whose backward does not.

    The final norm nearly switches channel 0 off (weight 1e-5) while the output head reads that channel
    with weights of 6e4: the logits stay small, but on the way back the head multiplies the loss gradient
    by 6e4 and the gradient reaching the norm's output exceeds 65504.
    """
    model = tiny_llama()
    with torch.no_grad():
        model.model.norm.weight[0] = 1e-5
        model.lm_head.weight[:, 0] = 6e4
        model.lm_head.weight[ANSWER, 0] = -6e4
    return model


def fp16_step(model, init_scale: float = 2.0):
    """One real fp16 mixed-precision step (CPU autocast + GradScaler): (logits finite, scale after, weights moved)."""
    before = model.lm_head.weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(**answer_batch())
    scaler.scale(out.loss).backward()
    scaler.step(opt)
    scaler.update()
    return bool(torch.isfinite(out.logits).all()), scaler.get_scale(), not torch.equal(before, model.lm_head.weight)


def test_probe_records_gradient_abs_max_per_module():
    result = run_probe(tiny_llama(), answer_batch())
    assert result.backward
    grads = {m.module: m.grad_absmax for m in result.modules}
    assert all(g is not None and g >= 0 for g in grads.values())
    assert grads["lm_head"] > 0 and grads["model.norm"] > 0
    assert result.backward_near_limit() == []
    module = next(m for m in result.modules if m.module == "model.norm")
    assert module.to_dict()["grad_headroom"] == FP16_MAX / module.grad_absmax


def test_forward_fits_fp16_backward_does_not_predicted_and_real(tmp_path):
    model = backward_only_overflow()
    result = run_probe(model, answer_batch())
    assert result.near_limit() == []  # the forward fits fp16 with room to spare
    near = {m["module"]: m for m in result.backward_near_limit()}
    assert "model.norm" in near and near["model.norm"]["grad_absmax"] > FP16_MAX

    f = nbguard.audit(model, args=make_args(tmp_path, fp16=True), batch=answer_batch(), hardware="t4",
                      probe=True).finding("fp16-overflow-risk")
    assert f is not None and f.severity == Severity.ERROR
    assert "modules_near_limit" not in f.evidence
    assert "model.norm" in [m["module"] for m in f.evidence["backward_near_limit"]["first"]]
    assert f.evidence["max_loss_scale"] < 1 and "below 1" in f.detail

    # The real thing: in fp16 the logits are finite, the backward overflows, the GradScaler skips the step.
    finite_logits, scale, moved = fp16_step(backward_only_overflow())
    assert finite_logits and scale == 1.0 and not moved


def test_healthy_model_backward_fits_and_the_real_step_goes_through(tmp_path):
    model = tiny_llama()
    f = nbguard.audit(model, args=make_args(tmp_path, fp16=True), batch=answer_batch(), hardware="t4", probe=True)
    assert "fp16-overflow-risk" not in f
    finite_logits, scale, moved = fp16_step(tiny_llama())
    assert finite_logits and scale == 2.0 and moved


def test_probe_without_trainable_parameters_has_no_gradients():
    model = tiny_llama().requires_grad_(False)
    result = run_probe(model, answer_batch())
    assert not result.backward and all(m.grad_absmax is None for m in result.modules)
    assert result.backward_near_limit() == []



def test_backward_probe_and_its_finding_fit_the_report_schema(tmp_path):
    import json

    import pytest

    from nbguard.reporting import build_report, schema

    jsonschema = pytest.importorskip("jsonschema")
    result = nbguard.audit(backward_only_overflow(), args=make_args(tmp_path, fp16=True), batch=answer_batch(),
                           hardware="t4", probe=True)
    data = json.loads(build_report(audit=result).to_json())
    jsonschema.Draft202012Validator(schema()).validate(data)
    probe = json.dumps(data)
    assert '"grad_absmax"' in probe and '"backward_near_limit"' in probe



def test_probe_leaves_no_hook_on_a_parameter_a_module_returns():
    class Table(torch.nn.Module):  # a learned table handed on as is: its output is a leaf parameter
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(4, 8))

        def forward(self):
            return self.weight

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.table = Table()
            self.proj = torch.nn.Linear(8, 1)

        def forward(self, input_ids):
            return {"loss": self.proj(self.table()[input_ids]).sum()}

    model = Model()
    result = run_probe(model, {"input_ids": torch.tensor([[0, 1]])})
    assert result.backward and {m.module for m in result.modules} >= {"table", "proj"}
    assert not model.table.weight._backward_hooks  # nothing of the probe outlives it
