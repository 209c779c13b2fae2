"""The docs cannot drift from the code: every registered audit rule, fix, error and warning signature,
event kind, cause and magic has its entry, with its description, on the generated reference pages
(read from the registries now, so a new one registered without a description fails here).
The strict site build itself runs where MkDocs is installed (the `docs` extra; `make docs`)."""
from __future__ import annotations

import importlib.util
import inspect
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import nbguard.auditor  # noqa: F401  (registers the rules)
import nbguard.fixes  # noqa: F401
from nbguard.auditor.registry import RULES
from nbguard.document.model import CAUSES, EVENT_KINDS
from nbguard.explainer.rules import RULES as ERROR_SIGNATURES
from nbguard.explainer.warnings import WARNING_SIGNATURES
from nbguard.fixes.registry import FIXES
from nbguard.notebook.magics import NbguardMagics

REPO = Path(__file__).resolve().parent.parent


def _generator():
    spec = importlib.util.spec_from_file_location("nbguard_docs_reference", REPO / "docs" / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def pages() -> dict[str, str]:
    return _generator().pages()


def _entry(page: str, heading: str) -> str:
    """The text of one entry: from its heading to the next heading of any level."""
    match = re.search(rf"^#+ {re.escape(heading)}\n(.*?)(?=^#+ |\Z)", page, re.S | re.M)
    assert match, f"no entry {heading!r} on the page"
    return match.group(1)


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z0-9]{4,}", text.lower()))


def test_every_audit_rule_has_its_entry_with_severity_description_and_fixes(pages):
    page = pages["reference/rules.md"]
    assert len(RULES) >= 20
    for rule in RULES.values():
        entry = _entry(page, rule.id)
        assert f"**Severity:** {rule.severity.value}" in entry
        assert _words(rule.description) <= _words(entry), f"{rule.id}: its docstring is not on the page"
        assert rule.description.strip(), f"audit rule {rule.id} has no docstring"
    # the fixes a rule offers are read from its code: fp16-overflow-risk offers switch-precision
    assert "fixes.md#switch-precision" in _entry(page, "fp16-overflow-risk")


def test_every_fix_has_its_entry_with_its_options(pages):
    page = pages["reference/fixes.md"]
    for fix in FIXES.values():
        entry = _entry(page, fix.id)
        assert fix.title in entry and fix.description.strip(), f"fix {fix.id} has no description"
        assert _words(fix.description) <= _words(entry), f"{fix.id}: its description is not on the page"
        for name in list(inspect.signature(fix.apply).parameters)[1:]:
            if name != "_":
                assert f"`{name}`" in entry, f"{fix.id}: option {name} is not on the page"
    assert "`max_norm` (default `1.0`)" in _entry(page, "enable-grad-clipping")


def test_every_signature_event_kind_and_cause_has_a_described_entry(pages):
    signatures = pages["reference/signatures.md"]
    for signature in [*ERROR_SIGNATURES, *WARNING_SIGNATURES]:
        assert len(_entry(signatures, signature).split()) >= 8, f"signature {signature} has no description"
    assert "**Heard on:** `logging:bitsandbytes`" in _entry(signatures, "linear4bit-input-dtype")
    events = pages["reference/events.md"]
    for kind in [*EVENT_KINDS, *CAUSES]:
        assert len(_entry(events, kind).split()) >= 6, f"{kind} has no description"


def test_a_registered_entry_without_a_description_fails_the_build(monkeypatch):
    from nbguard.document.model import EVENT_KIND_REGISTRY, EventKind

    generator = _generator()
    # register_event_kind refuses an empty description; an entry that slipped in another way still fails
    monkeypatch.setitem(EVENT_KIND_REGISTRY, "grad-spike", EventKind("grad-spike", " "))
    with pytest.raises(ValueError, match="event kind 'grad-spike' has no description"):
        generator.events_page()


def test_every_magic_manual_is_generated_from_its_magic_arguments(pages):
    page = pages["reference/magics.md"]
    names = {name for table in NbguardMagics.magics.values() for name in table.values()}
    assert names == {"precision_check", "nanwatch", "nbguard"}
    for name in names:
        entry = _entry(page, f"%{name}")
        for option in re.findall(r"--[a-z][a-z-]+", NbguardMagics.__dict__[name].__doc__):
            assert option in entry
    assert "--apply" in _entry(page, "%nbguard")


def test_the_api_page_documents_the_public_functions(pages):
    import nbguard

    for name in ("audit", "watch", "verify", "explain", "report"):
        assert getattr(nbguard, name).__doc__, f"nbguard.{name} has no docstring"
        assert f"::: nbguard.api.{name}" in pages["reference/api.md"]


@pytest.mark.slow
def test_the_site_builds_strictly_offline(tmp_path):
    """`mkdocs build --strict` (warnings are errors), with every notebook as a page."""
    mkdocs = shutil.which("mkdocs", path=os.path.dirname(sys.executable))
    if mkdocs is None:
        pytest.skip("MkDocs is not installed here (pip install -e '.[docs]'; make docs)")
    site = tmp_path / "site"
    result = subprocess.run([mkdocs, "build", "--strict", "--site-dir", str(site)], cwd=REPO,
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "NO_MKDOCS_2_WARNING": "1", "DISABLE_MKDOCS_2_WARNING": "true"})
    assert result.returncode == 0, result.stderr[-3000:]
    for page in ("reference/rules", "reference/fixes", "reference/signatures", "reference/events",
                 "reference/magics", "reference/api", "notebooks/00_quickstart", "guides/quickstart"):
        assert (site / f"{page}.html").is_file(), page
    assert "fp16-overflow-risk" in (site / "reference" / "rules.html").read_text()
    # the pages load no font, script, style or image from elsewhere (links out are fine)
    for page in site.rglob("*.html"):
        html = page.read_text()
        assert not re.search(r"""src=["']https?://|<link[^>]+stylesheet[^>]+href=["']https?://""", html), page
