"""Issue 32 item 3: the update-norm heatmap (||Δw|| / ||w|| per group and step) in the document's
view, so the HTML report, the notebook display, the Markdown report and the Lab extension draw it
beside the gradient-norm heatmap; nothing where the watch has no update norms."""
from __future__ import annotations

import base64
import html
import re

import pytest
import torch

import nbguard
from nbguard.document.view import UPDATES_ALT, view
from nbguard.render import heatmap_png, mime_bundle, render_text, update_norms_png
from nbguard.testing import tiny_batch, tiny_llama
from nbguard.watcher import NanWatch, WatchSettings

torch.set_num_threads(1)


def _watch(steps: int = 4, settings: WatchSettings | None = None):
    """A real watch over a tiny Llama trained by AdamW for ``steps`` steps, detached."""
    torch.manual_seed(0)
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    attached = NanWatch(model, optimizer=opt, settings=settings).attach() if settings is not None \
        else nbguard.watch(model, optimizer=opt, verify=False)
    with attached as watch:
        for step in range(steps):
            model(**tiny_batch(seed=step)).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return watch


def _images(page: str) -> dict[str, bytes]:
    """alt text -> PNG bytes of every embedded picture of an HTML page."""
    return {html.unescape(alt): base64.b64decode(data) for alt, data in
            re.findall(r'<img class="nbg-heatmap" alt="([^"]*)" src="data:image/png;base64,([^"]*)"', page)}


@pytest.fixture(scope="module")
def watched():
    return _watch()


def test_a_watch_with_update_norms_shows_their_heatmap_beside_the_gradient_norms(watched):
    doc = watched.to_document()
    section = view(doc).section("watch")
    assert [c.kind for c in section.charts] == ["heatmap", "updates", "series"]
    chart = section.charts[1]
    assert chart.alt == UPDATES_ALT and chart.source == ["history"] and not chart.empty
    assert "‖Δw‖ / ‖w‖" in chart.alt
    png = update_norms_png(doc["history"])
    assert png is not None and png.startswith(b"\x89PNG\r\n\x1a\n")
    assert png != heatmap_png(doc["history"])  # its own picture, not the gradients again


def test_the_html_report_and_the_notebook_display_embed_the_update_norm_picture(watched, tmp_path):
    doc = watched.to_document()
    expected = update_norms_png(doc["history"])
    report = nbguard.report(watch=watched)
    for page in (report.to_html(), mime_bundle(doc)["text/html"]):
        images = _images(page)
        assert images.get(UPDATES_ALT) == expected
        assert "gradient-norm heatmap" in images and images["gradient-norm heatmap"] != expected
    # the Markdown report saves it beside itself, like the gradient-norm heatmap
    saved = report.save(tmp_path / "run.md")
    assert (tmp_path / "run.updates.png").read_bytes() == expected
    assert f"![{UPDATES_ALT}](run.updates.png)" in saved.read_text()
    # the Lab extension's payload names it in its view
    payload = mime_bundle(doc)["application/vnd.nbguard.v1+json"]
    charts = next(s for s in payload["view"]["sections"] if s["kind"] == "watch")["charts"]
    assert {"kind": "updates", "alt": UPDATES_ALT, "source": ["history"], "empty": ""} in charts


def test_a_watch_without_update_norms_draws_none():
    off = _watch(steps=3, settings=WatchSettings(update_norms=False))
    doc = off.to_document()
    assert "update_norm" not in doc["history"]
    section = view(doc).section("watch")
    assert [c.kind for c in section.charts] == ["heatmap", "series"]
    assert UPDATES_ALT not in _images(mime_bundle(doc)["text/html"])
    assert "update-norm" not in render_text(doc)


def test_over_the_budget_the_fact_says_why_and_no_heatmap_is_drawn():
    over = _watch(steps=3, settings=WatchSettings(update_norm_budget_mb=0.01))
    doc = over.to_document()
    assert doc["history"].get("update_norm_unavailable")
    section = view(doc).section("watch")
    assert "updates" not in [c.kind for c in section.charts]
    assert any(f.text.startswith("no update norms: ") for f in section.facts)


def test_an_older_document_or_one_with_no_finite_update_norm_has_no_update_heatmap(watched):
    doc = watched.to_document()
    older = {**doc, "history": {k: v for k, v in doc["history"].items()
                                if k not in ("update_norm", "total_update_norm")}}
    assert [c.kind for c in view(older).section("watch").charts] == ["heatmap", "series"]
    unread = {**doc, "history": {**doc["history"],
                                 "update_norm": [[None, "nan"] + [None] * (len(doc["history"]["steps"]) - 2)
                                                 for _ in doc["history"]["groups"]]}}
    assert "updates" not in [c.kind for c in view(unread).section("watch").charts]
