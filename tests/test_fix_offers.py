"""Nothing offers a fix that is not registered: every producer (audit rules, explainer signatures, watch
event causes, diagnoses, verdicts) offers ids that ``nbguard.fixes`` applies and writes a cell for."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from audit_helpers import make_args
from verify_helpers import chat_batch, fp16_overflow_run, peft_zero_embeddings
from watch_helpers import batches, scale_output_to, train

import nbguard
from nbguard import fixes
from nbguard.errors import NonFiniteError
from nbguard.findings import CAUSES, FixOffer
from nbguard.hardware import detect
from nbguard.testing import tiny_llama
from nbguard.verifier import CAUSE_FIXES

torch.set_num_threads(1)
PACKAGE = Path(nbguard.__file__).parent


def assert_offerable(offers: list[FixOffer]) -> None:
    """Each offer names a registered fix with an action, and its cell can be written with the options."""
    assert offers and all(isinstance(o, FixOffer) for o in offers)
    for offer in offers:
        fix = fixes.get(offer.id)  # raises on an unknown id
        assert callable(fix.apply) and callable(fix.code)
        cell = fixes.code(offer.id, trainer="my_trainer", **offer.options)
        assert "my_trainer" in cell or fix.needs == "model-or-args", (offer, cell)


def offered_literals() -> dict[str, set[str]]:
    """Every fix id written in the source where something offers fixes: ``fixes=[...]`` of a finding or a
    diagnosis (keyword or the fifth positional argument of ``_diagnosis``), and list literals that are
    values of a ``*_FIXES`` table."""
    found: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            lists = []
            if isinstance(node, ast.Call):
                lists += [k.value for k in node.keywords if k.arg == "fixes"]
                name = getattr(node.func, "id", getattr(node.func, "attr", ""))
                if name == "_diagnosis" and len(node.args) >= 5:
                    lists.append(node.args[4])
            elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None and any(
                    getattr(t, "id", "").endswith("FIXES")
                    for t in (node.targets if isinstance(node, ast.Assign) else [node.target])):
                lists += [v for v in ast.walk(node.value) if isinstance(v, (ast.List, ast.Tuple))]
            for value in lists:
                if isinstance(value, (ast.List, ast.Tuple)):
                    for item in value.elts:
                        if isinstance(item, ast.Constant) and isinstance(item.value, str):
                            found.setdefault(item.value, set()).add(str(path.relative_to(PACKAGE)))
    return found


def test_every_fix_id_written_in_a_producer_is_registered():
    literals = offered_literals()
    assert {"switch-precision", "init-new-embeddings", "enable-input-require-grads"} <= set(literals)
    unknown = {fix_id: sorted(where) for fix_id, where in literals.items() if fix_id not in fixes.FIXES}
    assert unknown == {}


def test_every_event_cause_offers_registered_fixes_with_a_recipe():
    assert set(CAUSE_FIXES) and all(fixes.get(fix_id).plan is not None
                                     for ids in CAUSE_FIXES.values() for fix_id in ids)
    assert set(CAUSE_FIXES) <= set(CAUSES)  # a fix treats causes the watch can report
    assert CAUSE_FIXES["invalid-op"][:2] == ["init-new-embeddings", "pad-right-for-training"]  # ranked


def test_audit_offers_on_real_setups_are_registered(tmp_path):
    fp16 = nbguard.audit(model=tiny_llama(dtype=torch.float16), args=make_args(tmp_path, fp16=True), hardware="t4")
    assert_offerable(fp16.offers())
    bf16 = nbguard.audit(model=tiny_llama(dtype=torch.bfloat16), hardware="t4")
    assert_offerable(bf16.offers())
    assert FixOffer("switch-precision", {"to": "fp32"}) in bf16.offers()  # a T4 has no native bf16
    peft = nbguard.audit(model=peft_zero_embeddings(layers=2), batch=chat_batch(), hardware="a100")
    assert_offerable(peft.offers())
    assert {"init-new-embeddings", "upcast-trainable-fp32"} <= {o.id for o in peft.offers()}


def test_watch_events_and_their_verdicts_offer_registered_fixes():
    """The automatic verification ran every fix the event's cause offers (for_event), with its options."""
    _, _, watch = fp16_overflow_run()
    event = watch.events[0]
    offered = [FixOffer(v.fix, v.options) for v in watch.verification.verdicts]
    assert sorted(o.id for o in offered) == sorted(CAUSE_FIXES[event.cause])
    assert_offerable(offered)
    switch = next(o for o in offered if o.id == "switch-precision")
    assert switch.options == {"to": detect().best_half_precision}  # an fp16 step moves to this machine's best


def test_a_stop_diagnosis_offers_registered_fixes():
    model = tiny_llama()
    data = batches(1)
    scale_output_to(model, model.model.layers[1].mlp.up_proj, data[0], 2e5)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with pytest.raises(NonFiniteError) as info, nbguard.watch(model, optimizer=opt, policy="stop"):
        train(model, opt, data, autocast=torch.float16)
    diagnosis = nbguard.explain(info.value)
    assert_offerable(diagnosis.offers())


def test_an_unregistered_fix_cannot_be_offered():
    from nbguard.auditor.registry import finding
    from nbguard.explainer.diagnosis import Diagnosis

    with pytest.raises(ValueError, match="audit rule 'fp16-unscale-error' offers 'make-it-work', which is not a regis"):
        finding("fp16-unscale-error", "t", "d", fixes=["upcast-trainable-fp32", "make-it-work"])
    with pytest.raises(ValueError, match="error signature 'my-signature' offers 'make-it-work'"):
        Diagnosis("my-signature", "t", "d", "RuntimeError: x", ["make-it-work"])
    assert finding("fp16-unscale-error", "t", "d", fixes=["upcast-trainable-fp32"]).fixes == ["upcast-trainable-fp32"]
