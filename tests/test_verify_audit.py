"""Verification from the audit (verify=True, %precision_check --verify), the explainer, and as data."""
from __future__ import annotations

import json

import pytest
import torch
from notebook_helpers import MIME, run, shell  # noqa: F401
from verify_helpers import chat_batch, fp16_overflow_run, peft_zero_embeddings, verdicts
from watch_helpers import batches, scale_output_to, train

import nbguard
from nbguard import fixes
from nbguard.errors import NonFiniteError
from nbguard.fixes.registry import FIXES, Fix
from nbguard.testing import tiny_llama
from nbguard.verifier import FixVerdict, Verification

torch.set_num_threads(1)


def test_audit_verify_runs_the_findings_fixes_on_the_batch():
    model = peft_zero_embeddings()
    result = nbguard.audit(model=model, batch=chat_batch(), hardware="a100", verify=True)
    assert {"zero-embedding-rows", "trainable-low-precision"} <= result.rules
    got = verdicts(result.verification)
    assert got["init-new-embeddings"] == "verified" and got["upcast-trainable-fp32"] == "not enough"
    assert result.finding("zero-embedding-rows").evidence["verdicts"] == {"init-new-embeddings": "verified"}
    assert result.to_document()["verification"]["verdicts"][0]["fix"] == "init-new-embeddings"
    assert result.verification.baseline.healthy is False
    report = nbguard.report(audit=result).to_dict()  # the report carries the verdicts and the verified code
    [entry] = [e for e in report["entries"] if e.get("kind") == "audit"]
    assert "_w[_zero] = _w[_trained].float().mean(dim=0)" in entry["verification"]["verdicts"][0]["code"]


def test_audit_verify_on_a_healthy_step_checks_nothing():
    model = peft_zero_embeddings()
    with torch.no_grad():  # the new rows trained already: nothing overflows
        model.get_input_embeddings().weight[128:] = model.get_input_embeddings().weight[:128].mean(0)
    result = nbguard.audit(model=model, batch=chat_batch(), hardware="a100", verify=True)
    assert "zero-embedding-rows" not in result.rules and "trainable-low-precision" in result.rules
    v = result.verification.verdict("upcast-trainable-fp32")
    assert v.verdict == "not checked" and "healthy without it" in v.reason
    assert nbguard.audit(model=model, hardware="a100").verification is None
    with pytest.raises(TypeError, match="verify must be True or False"):
        nbguard.audit(model=model, verify="yes")


def test_precision_check_verify_shows_the_verdicts(shell):
    shell.user_ns.update(my_model=peft_zero_embeddings(), my_batch=chat_batch())
    cell = run(shell, "%precision_check my_model --verify --batch my_batch --hardware a100")
    [doc] = cell.docs
    assert cell.stderr == ""
    got = {v["fix"]: v["verdict"] for v in doc["verification"]["verdicts"]}
    assert got["init-new-embeddings"] == "verified" and got["upcast-trainable-fp32"] == "not enough"
    plain = run(shell, "%precision_check my_model --batch my_batch --hardware a100")
    assert "verification" not in plain.docs[0]


def _stopped(verify: bool):
    model = tiny_llama()
    data = batches(1)
    scale_output_to(model, model.model.layers[1].mlp.up_proj, data[0], 2e5)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with pytest.raises(NonFiniteError) as info, nbguard.watch(model, optimizer=opt, policy="stop", verify=verify):
        train(model, opt, data, autocast=torch.float16)
    return nbguard.explain(info.value)


def test_the_stop_diagnosis_offers_the_verified_fix_with_its_verdicts():
    diagnosis = _stopped(True)
    assert diagnosis.signature == "nbguard-stopped" and diagnosis.fixes == ["switch-precision"]
    assert diagnosis.fix_options == {"switch-precision": {"to": "bf16"}}
    doc = diagnosis.to_document()
    assert doc["verification"]["verdicts"][0] == diagnosis.verification["verdicts"][0]
    assert doc["verification"]["verdicts"][0]["verdict"] == "verified"
    assert "Train in bf16 instead of fp16" in doc["fix_cells"]["switch-precision"]["code"]
    off = _stopped(False)
    assert off.fixes == [] and off.verification is None and "verification" not in off.to_document()


def test_verification_is_data_that_round_trips_and_displays():
    _, _, watch = fp16_overflow_run()
    v = nbguard.verify(watch.events[0])
    data = v.to_dict()
    assert Verification.from_dict(json.loads(json.dumps(data))).to_dict() == data
    bundle = v._repr_mimebundle_()
    assert bundle[MIME]["kind"] == "verification" and bundle[MIME]["verification"]["verdicts"]
    assert {"text/plain", "text/html"} <= set(bundle)
    text = str(v)
    assert text.index("[verified]") < text.index("[not enough]") < text.index("[not checked]")
    with pytest.raises(ValueError, match="unknown verdict"):
        FixVerdict("x", "maybe", "")
    jsonschema = pytest.importorskip("jsonschema")
    from nbguard.document.schema import schema

    validator = jsonschema.Draft202012Validator(schema())
    validator.validate(bundle[MIME])
    validator.validate(nbguard.report(watch=watch).to_dict())  # the event's evidence carries the verdicts


def test_a_fix_without_a_recipe_is_not_checked_with_the_reason(monkeypatch):
    monkeypatch.setitem(FIXES, "pad-right", Fix("pad-right", "Pad on the right", "tokenizer.padding_side='right'",
                                                 lambda target, **_: {}, lambda names, **_: "tokenizer.padding_side = 'right'\n"))
    _, _, watch = fp16_overflow_run()
    [verdict] = nbguard.verify(watch.events[0], fix_id="pad-right").verdicts
    assert verdict.verdict == "not checked" and "no shadow recipe" in verdict.reason
    assert verdict.code == fixes.code("pad-right", model="model")


def test_audit_of_a_trainer_verifies_on_a_batch_from_its_dataloader():
    from verify_helpers import peft_trainer

    trainer = peft_trainer(peft_zero_embeddings())
    rng = torch.get_rng_state()
    result = nbguard.audit(trainer=trainer, hardware="a100", verify=True)
    assert result.verification.subject == "audit on a batch from the trainer's dataloader"
    assert verdicts(result.verification)["init-new-embeddings"] == "verified"
    assert torch.equal(rng, torch.get_rng_state())
