"""nbguard.report(): HTML, Markdown and JSON from real watched runs with planted faults;
redaction of secrets, escaping of hostile names, JSON round trip, self-containment."""
from __future__ import annotations

import json
import re

import pytest
from report_helpers import (
    HF_TOKEN,
    HOSTILE,
    WANDB_KEY,
    Refs,
    audit_document,
    planted_watch_document,
    watched_run_with_planted_fault,
)

import nbguard
import nbguard.fixes
from nbguard.document.merge import gather
from nbguard.findings import MIME_TYPE, document
from nbguard.render.markdown import GITHUB_BODY_LIMIT, md_code
from nbguard.reporting import Report, build_report, redact, schema
from nbguard.session import SESSION, record_audit, record_diagnosis, record_fix, record_watch
from nbguard.testing import tiny_batch

ENV_SECRET = "s3cr3t-Value-From-Env"
PASSWORD = "pa55word-Of-The-User"


@pytest.fixture
def secret_env(monkeypatch):
    monkeypatch.setenv("MY_SERVICE_TOKEN", ENV_SECRET)
    monkeypatch.setenv("DB_PASSWORD", PASSWORD)
    monkeypatch.setenv("WANDB_API_KEY", WANDB_KEY)
    return [ENV_SECRET, PASSWORD, WANDB_KEY, HF_TOKEN]


def planted_secrets_documents():
    """A real planted-fault watch and an audit, with secrets planted where they leak in practice."""
    watch = planted_watch_document()
    watch["events"][0]["message"] += f" (hub token {HF_TOKEN})"
    watch["events"][0]["evidence"]["cache_dir"] = f"/data/{ENV_SECRET}/cache"
    watch["events"][0]["origins"][0]["evidence"]["argv"] = f"--password {PASSWORD} --report-to wandb"
    audit = audit_document()
    audit["findings"][1]["evidence"]["hf_token"] = "anything-at-all"
    audit["findings"][1]["evidence"]["wandb"] = f"key={WANDB_KEY}"
    diagnosis = document("diagnosis", diagnoses=[{
        "signature": "cache-float-crash", "title": "HybridCache crash", "detail": "d",
        "exception": f"Traceback:\n  File \"/home/u/{ENV_SECRET}.py\"\nAttributeError: 'HybridCache' object has no "
                     f"attribute 'float' (token={HF_TOKEN})",
        "fixes": ["disable-use-cache"]}])
    fix = document("fix", fixes_applied=[{"fix": "disable-use-cache", "changed": {"use_cache": [True, False]},
                                          "code": f"os.environ['WANDB_API_KEY'] = '{WANDB_KEY}'", "time": 1.0}])
    return audit, watch, diagnosis, fix


def outside_code(markdown: str) -> str:
    """Markdown with fenced blocks and code spans removed: what GitHub would read as Markdown/HTML."""
    text = re.sub(r"(`{3,})[^\n]*\n.*?\n\1", "", markdown, flags=re.S)
    return re.sub(r"(`+)(?!`).+?(?<!`)\1(?!`)", "", text)


def test_every_format_from_a_real_run_carries_no_secret(tmp_path, secret_env):
    audit, watch, diagnosis, fix = planted_secrets_documents()
    for name, doc in (("watch", watch), ("audit", audit)):
        assert any(s in json.dumps(doc) for s in secret_env), name  # the secrets really are planted
    report = Report.from_dict(nbguard.reporting.merge_documents([audit, watch, diagnosis, fix]))
    paths = [report.save(tmp_path / f"r.{ext}") for ext in ("html", "md", "json")]
    outputs = [p.read_text(encoding="utf-8") for p in paths]
    outputs += [json.dumps(report.to_dict()), str(report)]
    outputs += [v if isinstance(v, str) else json.dumps(v) for v in report._repr_mimebundle_().values()]
    for text in outputs:
        for secret in secret_env + ["anything-at-all"]:
            assert secret not in text
    assert "[REDACTED:MY_SERVICE_TOKEN]" in outputs[2] and "[REDACTED]" in outputs[2]
    # the rest of the text survives redaction
    assert "HybridCache" in outputs[0] and "--password [REDACTED:DB_PASSWORD]" in outputs[2]


def test_secrets_set_after_building_are_redacted_when_saving(tmp_path, monkeypatch):
    report = Report.from_dict(document("watch", events=[{"kind": "watch-error", "step": 0,
                                                         "message": "failed reading late-secret-value-123",
                                                         "cause": None, "origins": [], "evidence": {}}]))
    monkeypatch.setenv("LATE_API_KEY", "late-secret-value-123")
    assert "late-secret-value-123" not in report.save(tmp_path / "r.json").read_text()


def test_redact_keeps_ordinary_text_and_numbers():
    data = {"supervised_tokens": 0, "loss": [1.0, "nan"], "msg": "tokenizers are fine; key: value", "hf_token": ""}
    assert redact(data, env={"TOKENIZERS_PARALLELISM": "false", "MY_KEY": "1"}, home=False) == data
    assert redact("/home/alice/run.py", env={}, home="/home/alice") == "~/run.py"
    assert redact("/work/alice2/run.py", env={}, home="/work/alice") == "/work/alice2/run.py"


def test_html_is_self_contained_escaped_and_printable(tmp_path):
    report = build_report(audit=audit_document(), watch=planted_watch_document())
    page = report.save(tmp_path / "report.html").read_text(encoding="utf-8")
    parser = Refs()
    parser.feed(page)
    parser.close()
    for tag, attrs in parser.tags:
        assert tag not in ("script", "link", "iframe", "object", "embed", "base")
        for key in ("src", "href", "action"):
            if key in attrs:
                assert attrs[key].startswith("data:"), (tag, key)
    assert not re.search(r"url\(|@import|https?://", page)  # nothing fetched by the CSS either
    # the watch's heatmap (drawn once, on the first screen beside the story) and its series
    images = [a for tag, a in parser.tags if tag == "img" and a["src"].startswith("data:image/png")]
    assert len(images) == 2 and len({a["src"] for a in images}) == 2
    assert "<script>" not in page and "&lt;script&gt;alert(&quot;x&quot;)" in page
    assert "@media print" in page and page.startswith("<!DOCTYPE html>")


def test_markdown_fits_an_issue_with_the_heatmap_beside_it(tmp_path):
    report = build_report(audit=audit_document(), watch=planted_watch_document())
    md_path = report.save(tmp_path / "sub" / "bug.md")  # missing folders are created
    text = md_path.read_text(encoding="utf-8")
    assert (tmp_path / "sub" / "bug.heatmap.png").read_bytes().startswith(b"\x89PNG")
    assert "![gradient-norm heatmap](bug.heatmap.png)" in text
    assert "![loss, total grad norm and loss scale per step](bug.series.png)" in text and (tmp_path / "sub" / "bug.series.png").exists()
    assert "<details><summary>" in text and len(text) < GITHUB_BODY_LIMIT
    assert md_code(f"model.layers.1.mlp.down_proj.{HOSTILE}") in text  # the hostile name shown as code ...
    assert "<script" not in outside_code(text)      # ... and never as HTML
    assert "&lt;script&gt;" in outside_code(text)   # escaped where it is plain text (the finding detail)


def test_markdown_of_a_huge_run_stays_under_the_issue_limit():
    watch = planted_watch_document()
    event = watch["events"][0]
    watch["events"] = [dict(event, step=i, message="x" * 400) for i in range(2000)]
    text = Report.from_dict(watch).to_markdown()
    assert len(text) < GITHUB_BODY_LIMIT and "more events not shown here; all of them are in the report's document" in text


def test_markdown_without_images_says_so():
    text = Report.from_dict(planted_watch_document()).to_markdown()
    assert "heatmap is not included in Markdown" in text


def test_json_round_trip_and_schema(tmp_path):
    report = build_report(audit=audit_document(), watch=[planted_watch_document(), planted_watch_document(6, 2)])
    path = report.save(tmp_path / "report.json")
    loaded = Report.load(path)
    assert loaded.to_dict() == report.to_dict()
    assert loaded.to_html() == report.to_html() and loaded.to_markdown() == report.to_markdown()
    assert str(loaded) == str(report)
    data = json.loads(path.read_text())
    assert data["schema_version"] == 1 and data["kind"] == "report"
    assert [w["title"] for w in gather(data, "watches")] == ["planted overflow (1)", "planted overflow (2)"]
    assert gather(data, "watches")[1]["history"]["skipped_steps"] == [2]
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.Draft202012Validator.check_schema(schema())
    jsonschema.Draft202012Validator(schema()).validate(data)
    bad = dict(data, watches=[{"events": [{"kind": "not-a-kind", "step": 0, "message": ""}]}])
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft202012Validator(schema()).validate(bad)


def test_save_checks_its_path(tmp_path):
    report = Report.from_dict(audit_document())
    with pytest.raises(ValueError, match=r"\.html, \.htm, \.md, \.json"):
        report.save(tmp_path / "report.pdf")
    with pytest.raises(TypeError, match="path"):
        report.save(42)
    assert report.save(str(tmp_path / "R.HTML")) == tmp_path / "R.HTML"


def test_load_rejects_what_it_cannot_read(tmp_path):
    (tmp_path / "a.json").write_text("<html>")
    with pytest.raises(ValueError, match="not a JSON nbguard report"):
        Report.load(tmp_path / "a.json")
    with pytest.raises(ValueError, match="schema_version 2"):
        Report.from_dict({"schema_version": 2, "kind": "report"})
    with pytest.raises(ValueError, match="not an nbguard document"):
        Report.from_dict({"findings": []})


def test_build_report_names_the_wrong_argument():
    with pytest.raises(TypeError, match="audit must be"):
        build_report(audit="results.json")
    with pytest.raises(TypeError, match=r"watch\[1\] must be"):
        build_report(watch=[planted_watch_document(), 3])


def test_report_display_bundle():
    bundle = build_report(watch=planted_watch_document())._repr_mimebundle_()
    assert set(bundle) == {"text/plain", "text/html", MIME_TYPE}
    assert bundle[MIME_TYPE]["kind"] == "report" and "environment" in bundle[MIME_TYPE]


# -- end to end: the real watch, audit, explainer and fixes ---------------------------------------

def test_report_of_the_session_after_a_real_watched_run(tmp_path, secret_env):
    model, watch = watched_run_with_planted_fault()
    assert any(w is watch for w in SESSION.watches)
    event = next(e for e in watch.events if e.kind.startswith("nonfinite"))
    assert event.step == 2 and event.origin("forward").module.endswith(HOSTILE)
    nbguard.audit(model, hardware="t4", batch=tiny_batch(2, 12), probe=True)
    try:
        raise AttributeError(f"'HybridCache' object has no attribute 'float' (HF_TOKEN={HF_TOKEN})")
    except AttributeError as exc:
        assert nbguard.explain(exc) is not None
    nbguard.fixes.apply("disable-use-cache", model=model)
    assert SESSION.audits and SESSION.diagnoses and SESSION.fixes_applied

    report = nbguard.report()
    data = report.to_dict()
    assert [len(w["events"]) >= 1 for w in gather(data, "watches")] == [True]
    assert gather(data, "watches")[0]["history"]["skipped_steps"] == [2]
    assert gather(data, "diagnoses")[0]["signature"] == "cache-float-crash"
    assert gather(data, "fixes_applied")[0]["fix"] == "disable-use-cache"
    # the story, in the order it happened
    assert [e["kind"] for e in data["entries"]] == ["watch", "audit", "diagnosis", "fix"]
    audit_entry = data["entries"][1]
    assert audit_entry["hardware"]["name"] == "t4" and data["environment"]["python"]
    assert any(m["module"].endswith(HOSTILE) for m in audit_entry["probe"]["modules"])  # the real probe section
    files = [report.save(tmp_path / f"session.{ext}") for ext in ("html", "md", "json")]
    for path in files:
        text = path.read_text(encoding="utf-8")
        assert all(secret not in text for secret in secret_env)
        if path.suffix != ".json":  # JSON keeps names as they are; HTML and Markdown must not run them
            assert "<script>" not in (text if path.suffix == ".html" else outside_code(text))
    html_text = files[0].read_text()
    assert "cache-float-crash" in html_text and "disable-use-cache" in html_text
    assert "data:image/png;base64," in html_text
    assert Report.load(files[2]).to_dict() == data
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.Draft202012Validator(schema()).validate(data)


def test_report_with_arguments_uses_them_and_keeps_the_sessions_fixes():
    _, watch = watched_run_with_planted_fault(steps=3, bad_step=1)
    record_fix("lower-learning-rate", {"learning_rate": [1e-3, 1e-4]}, "trainer.args.learning_rate = 1e-4")
    other = planted_watch_document()
    record_watch(type("Recorded", (), {"to_document": lambda self: other})())
    data = nbguard.report(watch=watch).to_dict()
    assert len(gather(data, "watches")) == 1 and gather(data, "watches")[0]["history"]["skipped_steps"] == [1]
    assert [f["fix"] for f in gather(data, "fixes_applied")] == ["lower-learning-rate"]


def test_a_broken_session_record_becomes_a_note():
    class Broken:
        def to_document(self):
            raise RuntimeError("kernel state gone")

    record_audit(audit_document())
    record_watch(Broken())
    record_diagnosis(object())
    report = nbguard.report()
    notes = report.to_dict()["notes"]
    assert any("watch 1" in n and "kernel state gone" in n for n in notes)
    assert any("diagnosis 1" in n for n in notes)
    assert gather(report.to_dict(), "findings")  # the audit still made it
    assert "Note: the session's watch 1 could not be included" in str(report)
