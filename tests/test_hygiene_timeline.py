"""The session as an ordered timeline of plain documents (recording side of issue 10 item 7).

Real audits, watches, fixes and diagnoses on tiny real models; the timeline keeps their order,
each entry gives a v1 document, and no entry keeps the user's model alive once a watch detached.
"""
from __future__ import annotations

import gc
import json
import weakref

import pytest
import torch

import nbguard
from nbguard.document import document
from nbguard.document.merge import gather
from nbguard.session import SESSION, record_verification
from nbguard.testing import tiny_batch, tiny_llama


def _train(model, opt, steps: int, poison_at: int | None = None) -> None:
    for step in range(steps):
        if step == poison_at:
            with torch.no_grad():
                model.model.layers[0].mlp.down_proj.weight[0, 0] = float("nan")
        opt.zero_grad()
        model(**tiny_batch()).loss.backward()
        opt.step()


def _before_and_after_a_fix():
    """The quickstart's story: audit, a watched run that goes NaN, the fix, a clean run, a re-audit."""
    model = tiny_llama(dtype=torch.float16)
    nbguard.audit(model, hardware="t4")
    model = model.float()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nbguard.watch(model, optimizer=opt, policy="skip"):
        _train(model, opt, 3, poison_at=1)
    try:
        torch.multinomial(torch.tensor([float("nan"), 1.0]), 1)
    except RuntimeError as exc:
        assert nbguard.explain(exc) is not None
    fresh = tiny_llama(dtype=torch.float16)
    nbguard.fixes.apply("upcast-trainable-fp32", model=fresh, names={"model": "fresh"})
    opt = torch.optim.SGD(fresh.parameters(), lr=0.1)
    with nbguard.watch(fresh, optimizer=opt):
        _train(fresh, opt, 2)
    nbguard.audit(fresh, hardware="t4")
    return model, fresh


def test_the_timeline_keeps_the_order_things_happened_in():
    _before_and_after_a_fix()
    kinds = [e.kind for e in SESSION.timeline]
    assert kinds == ["audit", "watch", "diagnosis", "fix", "watch", "audit"]
    times = [e.time for e in SESSION.timeline]
    assert times == sorted(times)
    docs = SESSION.documents()
    assert [d["kind"] for d in docs] == ["audit", "watch", "diagnosis", "fix", "watch", "audit"]
    assert all(d["schema_version"] == 1 for d in docs)
    json.dumps(docs, allow_nan=False)  # plain data
    before, after = docs[1], docs[4]
    assert before["events"][0]["kind"].startswith("nonfinite") and after["events"] == []
    assert "trainable-low-precision" in {f["rule"] for f in docs[0]["findings"]}
    assert "trainable-low-precision" not in {f["rule"] for f in docs[5]["findings"]}
    assert "fresh" in docs[3]["fixes_applied"][0]["code"]  # the user's own name, not a placeholder


def test_a_detached_watch_entry_is_only_a_document_and_frees_the_model():
    model, fresh = _before_and_after_a_fix()
    refs = [weakref.ref(model), weakref.ref(fresh)]
    del model, fresh
    gc.collect()
    assert [r() for r in refs] == [None, None]
    watches = SESSION.entries("watch")
    assert all(e.live() is None for e in watches)
    assert [d["history"]["steps"] for d in SESSION.watches] == [[0, 1, 2], [0, 1]]
    # what the quickstart does after %%nanwatch, whether or not the watch was collected yet
    assert SESSION.watches[-1].to_document()["history"]["steps"] == [0, 1]
    data = nbguard.report().to_dict()
    assert [w["history"]["steps"] for w in gather(data, "watches")] == [[0, 1, 2], [0, 1]]
    assert [e["kind"] for e in data["entries"]] == ["audit", "watch", "diagnosis", "fix", "watch", "audit"]


def test_an_attached_watch_entry_shows_the_live_watch():
    model = tiny_llama()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    watch = nbguard.watch(model, optimizer=opt)
    _train(model, opt, 1)
    [entry] = SESSION.entries("watch")
    assert entry.live() is watch and SESSION.watches == [watch]
    _train(model, opt, 1)
    assert entry.document()["history"]["steps"] == [0, 1]  # fresh, not the state at record time
    watch.detach()
    watch.attach()  # re-attaching keeps its one entry
    assert len(SESSION.entries("watch")) == 1
    watch.detach()


def test_the_audit_entry_is_the_document_at_record_time():
    model = tiny_llama(dtype=torch.float16)
    result = nbguard.audit(model, hardware="t4")
    [entry] = SESSION.entries("audit")
    assert SESSION.last_audit is result  # the result while the user keeps it
    nbguard.fixes.apply("upcast-trainable-fp32", model=model)
    assert "trainable-low-precision" in {f["rule"] for f in entry.document()["findings"]}  # as it was then
    del result
    gc.collect()
    assert {**SESSION.last_audit, "time": entry.time} == entry.document() and SESSION.last_audit["kind"] == "audit"


def test_verifications_are_recorded_from_any_object_with_to_document():
    class Verification:
        def to_document(self):
            return document("verification", title="fix verified", verified=True)

    record_verification(Verification())
    [entry] = SESSION.entries("verification")
    assert entry.kind == "verification" and entry.document()["verified"] is True
    assert SESSION.verifications == [entry.document()]
    with pytest.raises(AttributeError):
        record_verification(object())  # no to_document(): refused at once, nothing half-recorded
    assert len(SESSION.entries("verification")) == 1


def test_a_broken_entry_becomes_a_note_and_the_rest_of_the_story_stays():
    class Broken:
        def to_document(self):
            raise RuntimeError("kernel state gone")

    nbguard.audit(tiny_llama(), hardware="t4")
    nbguard.session.record_watch(Broken())
    docs = SESSION.documents()
    assert docs[0]["kind"] == "audit" and docs[0]["findings"] is not None
    assert docs[1]["kind"] == "watch" and "kernel state gone" in docs[1]["notes"][0]


def test_the_report_still_builds_from_the_session():
    _before_and_after_a_fix()
    data = nbguard.report().to_dict()
    assert len(gather(data, "watches")) == 2
    assert gather(data, "fixes_applied")[0]["fix"] == "upcast-trainable-fp32"
    assert gather(data, "diagnoses")[0]["signature"] == "sampling-nonfinite-probs"
