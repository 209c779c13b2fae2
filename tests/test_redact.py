"""Redaction by value: fix cells, module names and config keys pass through every format
byte-identical, while secrets planted where they leak in practice (the environment, an explained
exception's message, a config, a path) are gone from reports, saved outputs and live cards."""
from __future__ import annotations

import html
import json
import re

import pytest
from report_helpers import HF_TOKEN, audit_document, planted_watch_document

import nbguard.fixes  # noqa: F401  (registers the fixes)
from nbguard.document import MIME_TYPE
from nbguard.document import redact as redact_module
from nbguard.document.codec import encode_document
from nbguard.document.redact import redact, redact_also
from nbguard.explainer import diagnose
from nbguard.findings import document
from nbguard.fixes.registry import FIXES, Names
from nbguard.notebook.widgets.cards import DiagnosisView
from nbguard.render import mime_bundle
from nbguard.reporting import Report, merge_documents

GH_TOKEN = "ghp_" + "A1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q7r8"
OPENAI_KEY = "sk-" + "proj-" + "Zy9Xw8Vu7Ts6Rq5Po4Nm3Lk2"
DB_PASSWORD = "S3cretDbPass"
DATABASE_URL = f"postgres://admin:{DB_PASSWORD}@db.internal:5432/app"
GH_PAT = "pat-value-7c1e9a"
CONFIG_PASSWORD = "hunter2-config"
USER_SECRET = "my-own-secret-42"
SECRETS = [GH_TOKEN, OPENAI_KEY, DB_PASSWORD, GH_PAT, CONFIG_PASSWORD, HF_TOKEN, "/home/alice", "alice",
           USER_SECRET]
REAL_CELLS = ("pad-right-for-training", "init-new-embeddings")


@pytest.fixture
def secret_env(monkeypatch):
    monkeypatch.setenv("GH_PAT", GH_PAT)
    monkeypatch.setenv("DATABASE_URL", DATABASE_URL)
    monkeypatch.setenv("HF_TOKEN", HF_TOKEN)
    monkeypatch.setenv("NBGUARD_REDACT", USER_SECRET)


def fix_document() -> dict:
    cells = [{"fix": fix_id, "changed": {}, "code": FIXES[fix_id].code(Names()), "time": 1.0} for fix_id in REAL_CELLS]
    return document("fix", fixes_applied=cells)


def explained_error_document() -> dict:
    """A real diagnosis of a real exception whose message carries what people paste."""
    message = (f"'HybridCache' object has no attribute 'float' (while saving to {DATABASE_URL} with "
               f"Authorization: token {GH_TOKEN}, key {OPENAI_KEY}, {USER_SECRET}, "
               f"config {{'password': '{CONFIG_PASSWORD}'}}, from /home/alice/train.py)")
    try:
        raise AttributeError(message)
    except AttributeError as exc:
        diagnosis = diagnose(exc)
    assert diagnosis is not None, "the planted exception must be a known signature"
    doc = diagnosis.to_document()
    assert all(s in json.dumps(doc) for s in (GH_TOKEN, OPENAI_KEY, CONFIG_PASSWORD, "/home/alice"))  # really planted
    return doc


def every_format(tmp_path, doc: dict) -> dict[str, str]:
    report = Report.from_dict(doc)
    out = {ext: report.save(tmp_path / f"r.{ext}").read_text(encoding="utf-8") for ext in ("html", "md", "json")}
    bundle = mime_bundle(doc)
    out.update({f"saved {key}": value if isinstance(value, str) else json.dumps(value) for key, value in bundle.items()})
    return out


def test_real_fix_cells_and_evidence_pass_through_every_format_unchanged(tmp_path, secret_env):
    watch = planted_watch_document()
    doc = merge_documents([audit_document(), watch, fix_document()])
    cells = [FIXES[fix_id].code(Names()) for fix_id in REAL_CELLS]
    assert 'tokenizer.padding_side = "right"' in cells[0] and "token" in cells[1]
    out = every_format(tmp_path, doc)
    for cell in cells:
        assert html.escape(cell) in out["html"]
        assert cell in out["md"]
    saved, bundled = json.loads(out["json"]), json.loads(out[f"saved {MIME_TYPE}"])
    for data in (saved, bundled):
        entries = {entry["kind"]: entry for entry in data["entries"]}
        assert [f["code"] for f in entries["fix"]["fixes_applied"]] == cells
        # the real run's evidence (module names such as model.embed_tokens) is kept as it was
        assert {key: entries["watch"][key] for key in ("events", "history")} == {
            key: encode_document(watch)[key] for key in ("events", "history")}
    assert "embed_tokens" in json.dumps(watch["history"])
    assert "[REDACTED" not in out["json"] and "[REDACTED" not in out["md"]


def test_planted_secrets_are_gone_from_reports_saved_outputs_and_live_cards(tmp_path, secret_env):
    diagnosis = explained_error_document()
    audit = audit_document()
    audit["findings"][0]["evidence"]["config"] = {"password": CONFIG_PASSWORD, "pad_token": "<pad>"}
    audit["findings"][0]["evidence"]["cache_dir"] = f"/home/alice/.cache/{GH_PAT}"
    out = every_format(tmp_path, merge_documents([audit, diagnosis]))
    out.update({f"diagnosis {k}": v for k, v in every_format(tmp_path, diagnosis).items()})
    card = DiagnosisView(dict(diagnosis, output_id="o1"), "o1", None).widget
    out["live card"] = json.dumps([child.value for child in walk(card) if isinstance(getattr(child, "value", None), str)])
    for where, text in out.items():
        for secret in SECRETS:
            assert secret not in text, (where, secret)
    assert "'HybridCache' object has no attribute 'float'" in out["diagnosis saved text/plain"]
    assert "[REDACTED:DATABASE_URL]" in out["json"] and "Authorization: token [REDACTED]" in out["json"]
    assert '"pad_token": "<pad>"' in out["json"]


def walk(widget):
    yield widget
    for child in getattr(widget, "children", ()):
        yield from walk(child)


@pytest.mark.parametrize("text", [
    'tokenizer.padding_side = "right"', "model.embed_tokens.weight: 0.5", "tokenizer.pad_token = tokenizer.eos_token",
    "pad_token_id: 0", "key: value", "max_tokens=512 --max-new-tokens 20", "task-abcdefghijklmnopqrstuvwxyz0123",
    "resize_token_embeddings(len(tokenizer))", "/work/run.py", "Bearer of bad news",
    "# The template renders the BOS token: stop the tokenizer adding a second one", "--token none",
])
def test_code_names_and_config_keys_are_byte_identical(text):
    assert redact(text, env={"TOKENIZERS_PARALLELISM": "false", "PWD": "/work/run.py"}) == text


@pytest.mark.parametrize(("text", "kept"), [
    ("ghp_" + "x" * 36, ""), ("gho_" + "y" * 36, ""), ("github_pat_" + "11AB" * 10, ""),
    ("xoxb-" + "1234567890-abcdefgh", ""), ("AKIA" + "IOSFODNN7EXAMPL3", ""),
    ("eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.c2lnbmF0dXJl", ""),
    ("Authorization: Bearer abc.def-123456", "Authorization: Bearer "), ("mysql://root:pw123456@host/db", "mysql://"),
    ("{'password': 'pw-123456'}", "{'password': '"), ('os.environ["HF_TOKEN"] = "abc-123456"', 'os.environ["HF_TOKEN"] = "'),
    ("--hub-token abc-123456", "--hub-token "), ("password: pw123456", "password: "), ("C:\\Users\\alice\\run.py", "\\run.py"), ("/Users/alice/run.py", "/run.py"),
])
def test_token_shapes_quoted_keys_and_home_dirs_are_removed(text, kept):
    out = redact(text, env={})
    secret = re.sub(r"^.*?(pw-123456|abc-123456|abc\.def-123456|pw123456|alice).*$", r"\1", text) if kept else text
    assert secret not in out and kept in out


def test_redact_also_removes_what_the_user_names(monkeypatch):
    monkeypatch.setattr(redact_module, "_USER_VALUES", set())  # this session's additions end with the test
    monkeypatch.setattr(redact_module, "_USER_PATTERNS", [])
    redact_also("project-x-codename", re.compile(r"cust-\d{6}"))
    assert redact("run for project-x-codename on cust-123456", env={}) == "run for [REDACTED] on [REDACTED]"
    with pytest.raises(ValueError, match="at least"):
        redact_also("ab")


@pytest.mark.parametrize("fix_id", sorted(FIXES))
def test_every_registered_fix_cell_is_byte_identical_after_redaction(fix_id, secret_env):
    required = {"drop-rows": {"indices": [3, 17]}}  # the fixes whose cell needs an option with no default
    cell = FIXES[fix_id].code(Names(args="args", trainer="trainer"), **required.get(fix_id, {}))
    assert redact(cell) == cell
