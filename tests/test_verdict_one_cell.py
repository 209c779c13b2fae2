"""A verdict belongs to one exact cell: every place that shows a fix as verified shows the text that ran.

The quickstart's mechanism on real objects: a tiny Gemma 3 in fp16 whose rare token overflows layer 0,
audited for a T4, watched with skip. The watch verifies what the T4 would run (switch-precision to fp32,
never bf16); the card, the MIME bundle the Lab inserts from, ``%nbguard fix``'s printed verdict, its
inserted cell, the applied record and the report all carry that very text, byte for byte.
"""
from __future__ import annotations

import pytest
import torch
from notebook_helpers import run, shell  # noqa: F401 - the fixture
from quickstart_helpers import quickstart_into

import nbguard
from nbguard.document import MIME_TYPE
from nbguard.document.view import view
from nbguard.render import mime_bundle, render_html
from nbguard.session import SESSION, latest_verdict


def _verification(watch):
    """The verification the watch left on its first failing step (what it saw, if it left none)."""
    assert watch.verification is not None, [(e.kind, e.step, e.cause, e.evidence.get("verification_error"))
                                            for e in watch.events]
    return watch.verification


def _shown_fixes(doc: dict) -> list:
    """Every fix the view of ``doc`` shows with a verdict (cards of every section)."""
    return [f for s in view(doc).sections for c in s.cards for f in c.fixes if f.verdict is not None]


def _recorded_cells(doc: dict) -> set[tuple[str, str]]:
    """(fix id, the code that ran) of every verdict recorded in ``doc``'s verifications."""
    from nbguard.document.view import fix_verdicts

    return set(fix_verdicts(doc))


def test_every_place_that_shows_a_fix_verified_shows_the_cell_that_ran(shell, tmp_path):  # noqa: F811
    quickstart_into(shell, tmp_path)
    assert run(shell, "%precision_check trainer --hardware t4").error is None
    assert run(shell, "%%nanwatch trainer --policy skip\ntrainer.train()").error is None
    watch = SESSION.watches[-1]
    verdict = _verification(watch).verdict("switch-precision")
    # the target is the T4 named to the audit: the fp32 cell is what was run, bf16 never was
    assert verdict.options == {"to": "fp32"} and verdict.verdict == "verified"
    assert "bf16" not in str(verdict.options) and verdict.code.startswith("import torch")
    ran = verdict.code

    doc = watch.to_document()
    recorded = _recorded_cells(doc)
    shown = _shown_fixes(doc)
    assert any(f.id == "switch-precision" for f in shown)
    for f in shown:  # the card: each verdict shown beside the text that ran under it
        assert (f.id, f.code) in recorded, f.id
    bundle_fixes = [f for s in mime_bundle(doc)[MIME_TYPE]["view"]["sections"] for c in s["cards"]
                    for f in c["fixes"] if f.get("verdict")]
    switch = [f for f in bundle_fixes if f["id"] == "switch-precision"]
    assert switch and all(f["code"] == ran for f in switch)  # what the Lab's Insert puts in the notebook

    shell.rl_next_input = None
    cell = run(shell, "%nbguard fix switch-precision --apply")
    assert cell.error is None, cell.stdout
    assert "nbguard: switch-precision (to=fp32) verified on the failing step" in cell.stdout
    assert shell.rl_next_input == ran  # the inserted cell, byte for byte
    assert SESSION.fixes_applied[-1]["code"] == ran  # the applied cell, byte for byte

    report = nbguard.report().to_dict()
    story = next(s for s in view(report).sections if s.kind == "story")
    applied = [f.text for f in story.facts if f.text.startswith("Applied:")]
    assert applied == [applied[0]] and applied[0].startswith("Applied: switch-precision: this cell verified")
    recorded = set().union(*(_recorded_cells(e) for e in [report, *report["entries"]]))
    for f in _shown_fixes(report):
        assert (f.id, f.code) in recorded, f.id
    assert "Run after the fix: none yet" in [f.text for f in story.facts]
    html = render_html(report)
    assert "this cell verified on the failing step" in html


def test_a_verdict_never_travels_to_another_variant(shell, tmp_path):  # noqa: F811
    """Watched with no target named: this CPU runs bf16, so the bf16 cell is what the watch verified. Named
    a T4 afterwards, the fp32 cell is another text: it is run on the kept step before anything is claimed."""
    quickstart_into(shell, tmp_path)
    assert run(shell, "%%nanwatch trainer --policy skip\ntrainer.train()").error is None
    watch = SESSION.watches[-1]
    bf16 = _verification(watch).verdict("switch-precision")
    assert bf16.options == {"to": "bf16"} and bf16.verdict == "verified"
    assert run(shell, "%precision_check trainer --hardware t4").error is None
    shell.rl_next_input = None
    cell = run(shell, "%nbguard fix switch-precision")
    fp32 = shell.rl_next_input
    assert fp32 != bf16.code and latest_verdict("switch-precision", bf16.code).status == "verified"
    # the fp32 cell was run now, on the step the watch kept (skip left the weights as they were)
    assert "nbguard: switch-precision (to=fp32) verified on the failing step" in cell.stdout
    ran = [v for d in SESSION.verifications for v in d["verification"]["verdicts"] if v["fix"] == "switch-precision"]
    assert [v["code"] for v in ran] == [fp32] and ran[0]["options"] == {"to": "fp32"}


def test_an_unverifiable_cell_says_so_instead_of_borrowing_a_verdict(shell, tmp_path):  # noqa: F811
    """Once the weights moved, the kept step cannot be re-run: the fp32 cell is reported not verified."""
    quickstart_into(shell, tmp_path)
    assert run(shell, "%%nanwatch trainer --policy skip\ntrainer.train()").error is None
    assert _verification(SESSION.watches[-1]).verdict("switch-precision").options == {"to": "bf16"}
    with torch.no_grad():
        next(shell.user_ns["model"].parameters()).add_(1.0)  # an update after the failing step
    assert run(shell, "%precision_check trainer --hardware t4").error is None
    cell = run(shell, "%nbguard fix switch-precision")
    assert "nbguard: switch-precision (to=fp32) is not verified: this cell never ran on the failing step, " \
           "another variant of switch-precision did; the step the watch kept" in cell.stdout
    assert "verified on the failing step" not in cell.stdout
    # the latest audit names the target: a T4 now, this machine once an audit names none
    assert SESSION.target_hardware.name == "t4"
    nbguard.audit(trainer=shell.user_ns["trainer"])
    assert SESSION.target_hardware is None
