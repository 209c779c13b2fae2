"""Every path that produces text a user can share passes through the one redaction step: the
renderers (text view, static HTML, the MIME bundle), ``str()`` and display of real result objects,
``repr()`` of a finding or an event, a verification's ``str()``, a warning's first line cut to
length, ``%nbguard explain`` on an error no rule knows, ``%%nanwatch``'s summary, and the live
card's Apply error and ``changed`` value."""
from __future__ import annotations

import json
import re

import pytest
from notebook_helpers import run, shell  # noqa: F401  (the fixture)

import nbguard.render
from nbguard.auditor.result import AuditResult
from nbguard.explainer import diagnose
from nbguard.explainer.warnings import diagnose_warning
from nbguard.findings import Event, Finding, Severity
from nbguard.hardware import resolve_hardware
from nbguard.notebook.widgets.cards import FindingsView
from nbguard.notebook.widgets.fixrow import FixRow
from nbguard.reporting import Report
from nbguard.verifier.result import FixVerdict, Verification

HF = "hf_" + "Zq8Wm3Kd9Lp2Xr7Tn4Bv6Hc1Jy5Fg0Su"  # built here, not a literal secret
ANTHROPIC = "sk-ant-api03-" + "x_Y-" * 23 + "zAA"
PLANTED = f"/home/alice/run.py failed with token {HF} and key {ANTHROPIC}"
SECRETS = (HF[3:], ANTHROPIC[13:], "alice")


def windows(secret: str, size: int = 8) -> list[str]:
    return [secret[i:i + size] for i in range(len(secret) - size + 1)]


def assert_clean(text: str, where: str) -> None:
    for secret in SECRETS:
        left = [w for w in windows(secret, min(8, len(secret))) if w in text]
        assert not left, f"{where}: {left[:3]} of a planted secret survived"


def audit_result() -> AuditResult:
    """A real audit result whose finding's evidence carries what people paste."""
    finding = Finding("fp16-overflow-risk", Severity.ERROR, "Activations overflow fp16", f"Seen while {PLANTED}.",
                      {"module": "model.layers.0.mlp", "message": PLANTED}, ["switch-precision"])
    return AuditResult([finding], resolve_hardware("t4"))


def diagnosis():
    try:
        raise AttributeError(f"'HybridCache' object has no attribute 'float' ({PLANTED})")
    except AttributeError as exc:
        found = diagnose(exc)
    assert found is not None and HF in found.exception  # really planted in the real object
    return found


@pytest.mark.parametrize("make", [audit_result, diagnosis], ids=["audit result", "diagnosis"])
def test_str_and_display_of_real_results_are_redacted(make):
    result = make()
    assert HF in json.dumps(result.to_document(), default=str)  # the data itself still holds it
    assert_clean(str(result), "str()")
    for mime, value in result._repr_mimebundle_().items():
        assert_clean(value if isinstance(value, str) else json.dumps(value), mime)
    # the evidence is still there, a call away from the first screen
    assert "model.layers.0.mlp" in nbguard.render.render_text(audit_result().to_document(), full=True)


# The renderers of nbguard.render that turn a document into text someone can share.
RENDERERS = {
    "render_text": lambda doc: nbguard.render.render_text(doc),
    "render_html": lambda doc: nbguard.render.render_html(doc, standalone=True),
    "mime_bundle": lambda doc: json.dumps(nbguard.render.mime_bundle(doc)),
}


def test_every_renderer_redacts_what_it_formats(tmp_path):
    doc = audit_result().to_document()
    exported = {name for name in nbguard.render.__all__ if name.startswith("render_") or name == "mime_bundle"}
    assert exported == set(RENDERERS), "a new renderer: add it here, and redact what it formats"
    for name, render in RENDERERS.items():
        assert_clean(render(doc), name)
    report = Report(doc)
    assert_clean(str(report), "str(Report)")
    for ext in ("html", "md", "json"):
        assert_clean(report.save(tmp_path / f"r.{ext}").read_text(encoding="utf-8"), f"report .{ext}")


def test_a_token_across_the_warnings_300_character_cut_leaves_no_prefix():
    instance = "x" * (300 - len("Could not find response key `### Response:` in the following instance: ") - 6)
    text = (f"Could not find response key `### Response:` in the following instance: {instance} {HF} "
            f"This instance will be ignored in loss calculation.")
    assert text.index(HF) < 300 < text.index(HF) + len(HF)  # the cut falls inside the token
    found = diagnose_warning(text, "UserWarning")
    assert found is not None
    assert_clean(found.exception, "the diagnosis' first line")
    assert not re.search(r"hf_[A-Za-z0-9]+", found.exception)  # not even a short prefix
    assert_clean(str(found), "str()")
    assert_clean(json.dumps(found._repr_mimebundle_()), "display")


def test_explain_of_an_unrecognised_error_prints_it_redacted(shell):  # noqa: F811
    run(shell, f"raise ValueError({PLANTED!r})")
    cell = run(shell, "%nbguard explain")
    assert "no known signature in the last exception" in cell.stdout
    assert "ValueError" in cell.stdout and "[REDACTED]" in cell.stdout
    assert_clean(cell.stdout, "%nbguard explain")


def test_the_live_cards_apply_error_and_changed_value_are_redacted():
    def failing(fix_id):
        raise RuntimeError(f"could not load {PLANTED}")
    row = FixRow("switch-precision", "Train in bf16", "args.bf16 = True", "o1", failing)
    row.apply()
    assert "Apply failed: RuntimeError" in row.result.value
    assert_clean(row.result.value, "Apply error")

    changed = {"hub_token": HF, "cache": "/home/alice/.cache", "note": PLANTED}
    row = FixRow("switch-precision", "Train in bf16", "args.bf16 = True", "o1", lambda fix_id: (changed, "args.bf16 = True"))
    row.apply()
    assert "Changed:" in row.result.value and row.applied == changed
    assert_clean(row.result.value, "changed, in the row")

    result = audit_result()
    view = FindingsView(result, "o1", rerun=lambda: result, apply=lambda fix_id: (changed, "args.bf16 = True"),
                        names={})
    view.fix_row("fp16-overflow-risk", "switch-precision").apply()
    assert "Applied <code>switch-precision</code>" in view.header.value
    assert_clean(view.header.value, "changed, in the card's header")


def test_reprs_of_findings_and_events_are_redacted_before_they_are_cut():
    # the 100-character cut falls inside the token: a repr that cut first would keep its prefix
    detail = "x" * 90 + f" {HF} {PLANTED}"
    finding = Finding("fp16-overflow-risk", Severity.ERROR, f"Overflow near {HF}", detail, {}, [])
    event = Event("watch-error", 3, detail)
    for shown in (repr(finding), repr(event), repr([finding, event])):
        assert_clean(shown, "repr()")
        assert not re.search(r"hf_[A-Za-z0-9]+", shown)


def test_a_verifications_text_view_is_redacted():
    # a reason quotes the exception the shadow step raised under the fix
    verdict = FixVerdict("switch-precision", "not checked", f"the step raises under it: OSError: {PLANTED}")
    verification = Verification("event step 0 nonfinite-grad", [verdict], notes=[f"module level: {PLANTED}"])
    assert HF in verdict.reason  # really planted in the real object
    assert_clean(str(verification), "str(Verification)")
    assert "switch-precision" in str(verification)


def test_nanwatchs_summary_in_the_cell_output_is_redacted(shell, monkeypatch):  # noqa: F811
    import nbguard.notebook.present as present

    # a watch event's message can quote an exception; the summary is printed into the saved cell
    monkeypatch.setattr(present.LiveWatch, "summary", lambda self: f"nbguard watch: step 0 [watch-error] {PLANTED}")
    run(shell, "import torch\nnet = torch.nn.Linear(2, 2)\nopt = torch.optim.SGD(net.parameters(), lr=0.1)")
    cell = run(shell, "%%nanwatch net --optimizer opt\nnet(torch.ones(1, 2)).sum().backward()\nopt.step()")
    assert "[watch-error]" in cell.stdout, cell.stdout + cell.stderr
    assert_clean(cell.stdout, "%%nanwatch summary")
