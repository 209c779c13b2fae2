"""The static HTML shows everything the view says: every string of ``view(doc)`` of real documents
appears in ``render_html`` (after unescaping). The Lab extension's vitest suite checks the same of
its DOM on the same documents (labextension/test/parity.test.ts), so the two views cannot drift."""
from __future__ import annotations

import html

import pytest
from view_helpers import real_payloads, view_strings

from nbguard.document.view import view, without_view
from nbguard.render import render_html


@pytest.mark.parametrize("name", ["audit", "probe", "watch", "diagnosis", "healthy", "report"])
def test_every_view_string_of_a_real_document_is_in_the_static_html(name):
    data = real_payloads()[name]
    strings = view_strings(data["view"])
    page = html.unescape(render_html(without_view(data)))
    missing = [s for s in strings if s not in page]
    assert not missing, f"{name}: the static HTML leaves out {missing[:5]}"


def test_the_check_sees_a_string_the_html_leaves_out():
    data = real_payloads()["watch"]
    shown = view(without_view(data)).to_dict()
    shown["sections"][0]["facts"].append({"text": "a fact no renderer was given", "tone": ""})
    page = html.unescape(render_html(without_view(data)))
    assert "a fact no renderer was given" in view_strings(shown)
    assert "a fact no renderer was given" not in page


def test_view_strings_cover_every_part_of_a_report():
    strings = set(view_strings(real_payloads()["report"]["view"]))
    report = real_payloads()["report"]["view"]
    sections = report["sections"]
    assert {s["title"] for s in sections if s["title"]} <= strings
    watch = next(s for s in sections if s["kind"] == "watch")
    assert {f["text"] for f in watch["facts"]} <= strings and watch["cards"][0]["folds"]
    assert {fold["label"] for fold in watch["cards"][0]["folds"]} <= strings
    assert {cell for fold in watch["cards"][0]["folds"] if fold["table"] for row in fold["table"]["rows"]
            for cell in row} <= strings
    assert {c["alt"] for c in watch["charts"]} <= strings
