"""Renderers of the v1 document: text, static HTML, heatmap PNGs, the MIME bundle."""
from __future__ import annotations

import io
import json
import math
import re
from html.parser import HTMLParser

import numpy as np
import pytest
from report_helpers import HOSTILE, audit_document, planted_watch_document

from nbguard.document.grid import decode_grid
from nbguard.findings import MIME_TYPE, Displayable, document
from nbguard.render import activations_png, heatmap_png, mime_bundle, render_html, render_text
from nbguard.render.grid import aggregate, column_bins, row_bins

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def full_document() -> dict:
    """Every section of the v1 document at once: audit + real watch run + diagnosis + fixes."""
    audit = audit_document()
    watch = planted_watch_document()
    return document(
        "report", title="everything",
        findings=audit["findings"], probe=audit["probe"], hardware=audit["hardware"], fix_cells=audit["fix_cells"],
        events=watch["events"], history=watch["history"],
        activations={"groups": ["model.layers.0", "model.layers.1"], "steps": [0, 1, 2],
                     "absmax": [[10.0, 1e5, "inf"], [1.0, 2.0, None]], "limit": 65504.0},
        diagnoses=[{"signature": "hybridcache-float", "title": "Gemma 3 eval crash",
                    "detail": "HybridCache has no .float()",
                    "exception": "Traceback (most recent call last):\nAttributeError: 'HybridCache' object has no attribute 'float'",
                    "fixes": ["disable-cache"]}],
        fixes_applied=[{"fix": "use-bf16", "changed": {"args.fp16": [True, False]}, "code": "args.bf16 = True",
                        "time": 1_700_000_000.0}],
        environment={"python": "3.11.2", "platform": "Linux", "packages": {"torch": "2.13.0"}},
    )


class TagCollector(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data):
        self.text.append(data)


def parse(html_text: str) -> TagCollector:
    parser = TagCollector()
    parser.feed(html_text)
    parser.close()
    return parser


def test_planted_run_is_real():
    doc = planted_watch_document()
    hist = doc["history"]
    assert hist["skipped_steps"] == [5]
    assert hist["loss"][5] == "nan" and all(isinstance(v, float) for i, v in enumerate(hist["loss"]) if i != 5)
    origin = doc["events"][0]["origins"][0]
    assert origin["module"].endswith(HOSTILE) and origin["output_absmax"] == "inf"


def test_mime_bundle_has_all_three_entries_and_strict_json():
    doc = full_document()
    doc["evidence_extra"] = {"np": np.float32(1.5), "arr": np.array([1.0, np.nan]), "nan": float("nan")}
    bundle = mime_bundle(doc)
    assert set(bundle) == {"text/plain", "text/html", MIME_TYPE}
    data = bundle[MIME_TYPE]
    text = json.dumps(data, allow_nan=False)
    assert json.loads(text)["evidence_extra"] == {"np": 1.5, "arr": [1.0, "nan"], "nan": "nan"}
    assert data["schema_version"] == 1 and data["kind"] == "report"


def test_mime_bundle_redacts_secrets(monkeypatch):
    from report_helpers import HF_TOKEN

    monkeypatch.setenv("MY_SERVICE_TOKEN", "service-secret-value")
    doc = planted_watch_document()
    doc["events"][0]["message"] += f" {HF_TOKEN} service-secret-value"
    bundle = mime_bundle(doc)
    for value in bundle.values():
        text = value if isinstance(value, str) else json.dumps(value)
        assert HF_TOKEN not in text and "service-secret-value" not in text
    assert "[REDACTED:MY_SERVICE_TOKEN]" in bundle["text/plain"]


def test_mime_bundle_rejects_non_documents():
    with pytest.raises(TypeError, match="doc"):
        mime_bundle(["not", "a", "document"])


COMPACT_LEAVES_OUT = ("what changed:", "args.bf16 = True", "model.config.use_cache = False")  # evidence, cells


def test_text_shows_every_section():
    text = render_text(full_document(), full=True)
    compact = render_text(full_document())
    for needle in (
        "Activations overflow fp16",          # findings
        "[ERROR]", "[WARNING]",
        "Activation probe", "Limit 65504",    # probe
        "over limit",
        "step 5: ", "(nonfinite-loss)", "cause: overflow",  # events
        f"down_proj.{HOSTILE}",               # origin module
        "first non-finite gradient: NaN at step 5",  # history
        "1 skipped step: 5",
        "activation abs-max recorded for 2 groups",
        "Explained exceptions (1)", "Gemma 3 eval crash",  # diagnoses
        "AttributeError: 'HybridCache' object has no attribute 'float'",
        "use-bf16", "what changed:",          # fixes applied
        "args.bf16 = True",                   # fix cells
        "model.config.use_cache = False",
        "Environment", "Python 3.11.2",
        "NVIDIA Tesla T4",                    # hardware
    ):
        assert needle in text, needle
        # the first screen keeps every section and its words; cells and evidence are a call away, said so
        assert (needle not in compact) == (needle in COMPACT_LEAVES_OUT), needle
    assert "render_text(x.to_document(), full=True)" in compact and "full=True" not in text


def test_text_of_an_empty_audit_says_nothing_to_fix():
    assert "No findings: nothing to fix." in render_text(document("audit", findings=[]))


def test_html_escapes_hostile_names_and_parses():
    html_text = render_html(full_document())
    assert "<script>" not in html_text and 'alert("x")' not in html_text
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;&amp;&#x27;q" in html_text
    parsed = parse(html_text)
    assert not any(tag == "script" for tag, _ in parsed.tags)
    text = "".join(parsed.text)
    assert HOSTILE in text  # readable after unescaping: the name is shown, not dropped
    assert "first non-finite gradient: NaN at step 5" in text
    assert "1 skipped step: 5" in text


def test_html_shows_every_section_and_embeds_the_heatmaps():
    parsed = parse(render_html(full_document()))
    text = "".join(parsed.text)
    for needle in ("Findings (3)", "Activation probe", "over limit", "Events (1)", "Explained exceptions (1)",
                   "Fixes applied (1, in order)", "Environment", "args.bf16 = True", "NVIDIA Tesla T4"):
        assert needle in text, needle
    images = [attrs for tag, attrs in parsed.tags if tag == "img"]
    # the story's heatmap is its watch's own: drawn once per output (issue 41), the watch's other charts after it
    assert [img["alt"] for img in images] == ["gradient-norm heatmap of the run that failed",
                                              "loss, total grad norm and loss scale per step",
                                              "activation abs-max heatmap"]
    for img in images:
        assert img["src"].startswith("data:image/png;base64,")


def test_html_references_nothing_outside_itself():
    for standalone in (False, True):
        parsed = parse(render_html(full_document(), standalone=standalone))
        for tag, attrs in parsed.tags:
            assert tag not in ("script", "link", "iframe", "object", "embed")
            for attr in ("src", "href"):
                if attr in attrs:
                    assert attrs[attr].startswith("data:"), (tag, attrs[attr][:40])


def test_standalone_page_is_complete():
    page = render_html(full_document(), standalone=True)
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert "@media print" in page and '<meta charset="utf-8">' in page


def test_a_broken_section_does_not_hide_the_others():
    doc = full_document()
    doc["probe"] = {"modules": "not a list of modules"}
    html_text = render_html(doc)
    assert "could not render probe" in html_text and "Explained exceptions" in html_text
    assert "could not render probe" in render_text(doc)


def test_displayable_results_use_the_renderers():
    class Result(Displayable):
        def to_document(self):
            return planted_watch_document()

    bundle = Result()._repr_mimebundle_()
    assert set(bundle) == {"text/plain", "text/html", MIME_TYPE}
    assert "data:image/png;base64," in bundle["text/html"]
    assert "nonfinite-loss" in str(Result())


def _pixels(png: bytes) -> np.ndarray:
    from matplotlib.image import imread

    assert png.startswith(PNG_MAGIC)
    return (imread(io.BytesIO(png))[..., :3] * 255).round().astype(int)


def _count(pixels: np.ndarray, hex_color: str) -> int:
    """How many pixels have this colour (the legend swatches count too: compare with a baseline)."""
    rgb = [int(hex_color[i:i + 2], 16) for i in (1, 3, 5)]
    return int((np.abs(pixels - rgb).sum(axis=-1) <= 6).sum())


def big_history(nan_at=None, inf_at=None):
    rng = np.random.default_rng(1)
    groups = [f"model.layers.{i // 7}.proj{i % 7}" for i in range(200)]
    grid = np.exp(rng.normal(0, 1, (200, 2000))).tolist()
    if nan_at:
        grid[nan_at[0]][nan_at[1]] = "nan"
    if inf_at:
        grid[inf_at[0]][inf_at[1]] = "inf"
    return {"groups": groups, "steps": list(range(2000)), "grad_norm": grid, "skipped_steps": [10]}


def test_one_nan_among_400k_cells_stays_visible():
    from nbguard.render.heatmap import NAN_COLOR

    clean = _pixels(heatmap_png(big_history()))
    bad = _pixels(heatmap_png(big_history(nan_at=(123, 1777))))
    assert _count(bad, NAN_COLOR) >= _count(clean, NAN_COLOR) + 6  # a cell of several pixels plus the track mark
    assert bad.shape[0] < 1400 and bad.shape[1] < 1700  # binned: a readable figure, not a wall


def test_binning_keeps_the_worst_cell():
    hist = big_history(nan_at=(5, 7), inf_at=(150, 1999))
    values, missing = decode_grid(hist["grad_norm"], 200, 2000)
    rows, cols = row_bins(hist["groups"], 48), column_bins(hist["steps"], 400)
    assert rows.count <= 48 and cols.count <= 400
    assert rows.labels[0] == "model.layers.0 (7)"  # merged by block, not by arbitrary chunks
    agg = aggregate(values, missing, rows, cols)
    assert agg.nan.sum() == 1 and agg.inf.sum() == 1
    assert agg.nan[0, 7 // 5] and agg.inf[150 // 7, 1999 // 5]  # rows are blocks of 7, columns bins of 5
    finite_max = np.nanmax(np.where(np.isfinite(values), values, np.nan))
    assert math.isclose(np.nanmax(agg.values), finite_max)


def test_row_bins_fall_back_to_ranges_for_flat_names():
    groups = [f"model.layers.{i}" for i in range(200)]
    bins = row_bins(groups, 40)
    assert bins.count == 40 and bins.labels[0] == "model.layers.0–4" and bins.labels[-1] == "model.layers.195–199"


def test_decode_grid_reads_strings_nulls_and_ragged_rows():
    values, missing = decode_grid([[1, "nan", None], ["inf"], "junk"], 3, 3)
    assert values[0, 0] == 1 and math.isnan(values[0, 1]) and missing[0, 2] and not missing[0, 1]
    assert values[1, 0] == math.inf and missing[1, 1:].all() and missing[2].all()
    values, missing = decode_grid([[2, "garbage", "-inf"]], 1, 3)
    assert values[0, 0] == 2 and missing[0, 1] and values[0, 2] == -math.inf and not missing[0, 2]


def test_heatmap_marks_inf_and_skipped_steps():
    from nbguard.render.heatmap import INF_COLOR, NAN_COLOR, SKIP_COLOR

    clean = {"groups": ["a", "b"], "steps": [0, 1, 2, 3], "grad_norm": [[1, 2, 3, 1], [1, 2, 3, 4]]}
    bad = dict(clean, grad_norm=[[1, 2, "inf", 1], [1, 2, 3, 4]], skipped_steps=[2])
    before, after = _pixels(heatmap_png(clean)), _pixels(heatmap_png(bad))
    assert _count(after, INF_COLOR) > _count(before, INF_COLOR) + 100
    assert _count(after, SKIP_COLOR) > _count(before, SKIP_COLOR) + 20
    assert _count(after, NAN_COLOR) == _count(before, NAN_COLOR)


def test_heatmap_of_the_real_run():
    from nbguard.render.heatmap import NAN_COLOR

    history = planted_watch_document()["history"]
    healthy = dict(history, grad_norm=[[1.0] * len(history["steps"]) for _ in history["groups"]])
    assert _count(_pixels(heatmap_png(history)), NAN_COLOR) > _count(_pixels(heatmap_png(healthy)), NAN_COLOR) + 100


def test_activations_png_marks_cells_over_the_limit():
    from nbguard.render.heatmap import OVER_COLOR

    over = {"groups": ["a"], "steps": [0, 1], "absmax": [[10.0, 70000.0]], "limit": 65504.0}
    under = dict(over, absmax=[[10.0, 100.0]])
    assert _count(_pixels(activations_png(over)), OVER_COLOR) > _count(_pixels(activations_png(under)), OVER_COLOR) + 100


def test_heatmap_rejects_bad_sections():
    with pytest.raises(TypeError, match="history"):
        heatmap_png([[1, 2]])
    with pytest.raises(ValueError, match="grad_norm"):
        heatmap_png({"groups": [], "steps": []})
    with pytest.raises(ValueError, match="limit"):
        activations_png({"groups": [], "steps": [], "absmax": [], "limit": "high"})


def test_history_summary_names_the_group_or_counts_them():
    one = {"groups": ["a", "b", "c"], "steps": [0, 1], "grad_norm": [[1, 1], [1, "nan"], [1, 1]]}
    assert "first non-finite gradient: NaN at step 1 in b (" in render_text(document("watch", history=one))
    spread = dict(one, grad_norm=[[1, "nan"], [1, "nan"], [1, "inf"]])
    assert "in all 3 of 3 groups (first: a)" in render_text(document("watch", history=spread))
    assert "all 3 of 3 groups (first: a)" in render_html(document("watch", history=spread))
    assert "all 21 of 21 groups" in render_text(planted_watch_document())  # the real run: NaN spreads


def test_saved_page_folds_every_cell_once():
    page = render_html(full_document(), standalone=True)
    assert "<details>" in page and "<details open>" not in page  # cells and evidence a click away (issue 41)
    summaries = re.findall(r"<details><summary>(.*?)</summary>", page)
    # nothing here was verified: each card's first fix is shown plainly, none is called "recommended"
    assert any(s.startswith("fix <code>use-bf16</code>") for s in summaries), summaries
    assert "recommended fix" not in page
    cells = re.findall(r"<pre><code>(.*?)</code></pre>", page, re.S)
    assert cells and len(cells) == len(set(cells))  # each block once


def test_series_png_marks_non_finite_steps():
    from nbguard.render import series_png
    from nbguard.render.heatmap import NAN_COLOR

    history = planted_watch_document()["history"]
    healthy = dict(history, loss=[1.0] * 8, total_grad_norm=[1.0] * 8)
    assert _count(_pixels(series_png(history)), NAN_COLOR) > _count(_pixels(series_png(healthy)), NAN_COLOR) + 100
    assert series_png({"groups": [], "steps": [0], "grad_norm": []}) is None  # no series recorded: no picture


def test_pretty_json_is_json_with_short_lists_inline():
    from nbguard.document import pretty_json

    value = {"shape": [2, 16, 64], "nested": {"rows": [{"a": 1}, [1, "x"]], "s": 'q"<>'}, "empty": [], "none": {}}
    text = pretty_json(value)
    assert json.loads(text) == value and '"shape": [2, 16, 64]' in text


def test_heatmap_of_a_watch_before_its_first_step():
    for section in ({"groups": ["a"], "steps": [], "grad_norm": [[]]}, {"groups": [], "steps": [0], "grad_norm": []}):
        png = heatmap_png(section)
        assert png.startswith(PNG_MAGIC) and _pixels(png).shape[0] < 120  # a one-line note, not an error


def test_heading_names_the_document_once():
    from nbguard.findings import document
    from nbguard.render import render_html, render_text
    from nbguard.render.markdown import render_markdown

    titled = document("report", title="nbguard report", findings=[])
    html_out = render_html(titled)
    heading_html = html_out[html_out.index("<h2>"):html_out.index("</h2>")]
    assert heading_html.count("nbguard report") == 1
    assert render_text(titled).splitlines()[0].count("nbguard report") == 1
    assert "nbguard audit" in render_text(document("audit", findings=[])).splitlines()[0]
    assert render_markdown(titled).count("## nbguard report") == 1
