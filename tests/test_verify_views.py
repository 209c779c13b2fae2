"""Verdicts in every view: the watch verified the fixes on the failing step of the PEFT
zero-embeddings case; the event card offers them verified first, and the text, static HTML,
Markdown, the Lab payload and the report all show the same verdicts and the verified cell."""
from __future__ import annotations

import html

import pytest
from notebook_helpers import run, shell  # noqa: F401  (the fixture)
from verify_helpers import peft_trainer, peft_zero_embeddings

import nbguard
from nbguard.document import MIME_TYPE
from nbguard.document.view import view
from nbguard.render import mime_bundle, render_html, render_text
from nbguard.render.markdown import render_markdown


def test_the_watch_verdicts_show_in_every_view_verified_first():
    trainer = peft_trainer(peft_zero_embeddings())
    with nbguard.watch(trainer, policy="skip") as watch:
        trainer.train()
    doc = watch.to_document()
    section = view(doc).section("watch")
    event, verification = section.cards[0], section.cards[1]
    assert [(f.id, f.verdict.label) for f in event.fixes][0] == ("init-new-embeddings", "verified")
    labels = {f.id: f.verdict.label for f in event.fixes}
    assert labels["upcast-trainable-fp32"] == "not enough"
    assert event.fixes[-1].verdict.status == "not-enough" or event.fixes[-1].verdict.status == "not-checked"
    assert "_w[_zero] = _w[_trained].float().mean(dim=0)" in event.fixes[0].code  # the exact verified cell
    assert verification.title == "Fixes run on step 0" or verification.title.startswith("Fixes run on step")
    rows = {row[0]: row for row in verification.table.rows}
    assert rows["init-new-embeddings"][1] == "verified" and rows["upcast-trainable-fp32"][1] == "not enough"
    assert "float32" in rows["upcast-trainable-fp32"][5]  # the precision the shadow step ran in

    text, page, md = render_text(doc), html.unescape(render_html(doc)), render_markdown(doc)
    # the first screen: the recommended fix first with its verdict, the others in the same line
    assert "fix: init-new-embeddings [verified]; others: " in text and "upcast-trainable-fp32 [not enough]" in text
    full = render_text(doc, full=True)
    assert "fix init-new-embeddings" in full and "[verified" in full and "[not enough" in full
    assert 'nbg-verdict-verified' in render_html(doc) and "not enough" in page
    assert "`init-new-embeddings` (verified, recommended)" in md
    payload = mime_bundle(doc)[MIME_TYPE]
    fixes = payload["view"]["sections"][0]["cards"][0]["fixes"] if payload["view"]["sections"][0]["kind"] == "watch" \
        else next(s for s in payload["view"]["sections"] if s["kind"] == "watch")["cards"][0]["fixes"]
    assert fixes[0]["verdict"]["status"] == "verified"

    data = nbguard.report().to_dict()
    watch_entry = next(e for e in data["entries"] if e["kind"] == "watch")
    assert watch_entry["events"][0]["evidence"]["verification"]["verdicts"][0]["fix"] == "init-new-embeddings"
    assert "Fixes run on step" in render_text(data)


def test_a_verification_document_is_one_card_with_the_evidence_and_cells():
    trainer = peft_trainer(peft_zero_embeddings())
    with nbguard.watch(trainer, policy="skip") as watch:
        trainer.train()
    result = nbguard.verify(watch.events[0])  # every candidate, not only the automatic two
    doc = result.to_document()
    card = view(doc).section("verifications").cards[0]
    assert card.fixes[0].verdict.status == "verified" and card.fixes[0].code
    assert {row[1] for row in card.table.rows} >= {"verified", "not enough", "not checked"}
    assert any(f.label == "baseline step (no fix)" for f in card.folds)
    assert "Verified fixes" in render_text(doc)


def test_nbguard_fix_says_whether_the_fix_was_verified_on_the_failing_step(shell):
    trainer = peft_trainer(peft_zero_embeddings())
    shell.user_ns["trainer"] = trainer
    assert run(shell, "%%nanwatch trainer --policy skip\ntrainer.train()").error is None
    cell = run(shell, "%nbguard fix init-new-embeddings")
    assert cell.error is None and "nbguard: init-new-embeddings verified on the failing step" in cell.stdout
    cell = run(shell, "%nbguard fix upcast-trainable-fp32")
    assert "nbguard: upcast-trainable-fp32 not enough on the failing step" in cell.stdout
    # never run on the step by the watch: this very cell is run on the kept step first, and says what it found
    cell = run(shell, "%nbguard fix disable-use-cache")
    assert cell.error is None and "nbguard: disable-use-cache not checked on the failing step: it changes nothing" \
        in cell.stdout
