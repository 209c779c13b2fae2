"""The session report tells the story in order: the audit that found the error, the fix, the audit
after it; and plots of an all-non-finite series say so instead of drawing an empty axis."""
from __future__ import annotations

import html

import jsonschema
import pytest
from audit_helpers import seed_peft_model

import nbguard
import nbguard.fixes
from nbguard.document import document
from nbguard.document.schema import schema
from nbguard.document.view import view
from nbguard.render import render_html, render_text
from nbguard.render.markdown import render_markdown


def test_report_shows_the_error_before_the_fix_and_the_clean_audit_after_it():
    model = seed_peft_model()
    before = nbguard.audit(model, hardware="a100")
    assert "trainable-low-precision" in {f.rule for f in before.findings}
    nbguard.fixes.apply("upcast-trainable-fp32", model=model)
    after = nbguard.audit(model, hardware="a100")
    assert "trainable-low-precision" not in {f.rule for f in after.findings}

    data = nbguard.report().to_dict()
    assert [e["kind"] for e in data["entries"]] == ["audit", "fix", "audit"]
    first, fix, second = data["entries"]
    assert first["time"] <= fix["time"] <= second["time"]
    assert "trainable-low-precision" in {f["rule"] for f in first["findings"]}
    assert "trainable-low-precision" not in {f["rule"] for f in second["findings"]}
    assert fix["fixes_applied"][0]["fix"] == "upcast-trainable-fp32"
    jsonschema.Draft202012Validator(schema()).validate(data)
    with pytest.raises(jsonschema.ValidationError):  # the schema does describe entries
        jsonschema.Draft202012Validator(schema()).validate({**data, "entries": [{"kind": "no-such-kind"}]})

    titles = [s.title for s in view(data).sections if s.kind == "entry"]
    def findings(n: int) -> str:
        return f"{n} finding" + ("" if n == 1 else "s")

    assert [t.split(" (")[0] for t in titles] == [
        f"1. Audit: {findings(len(first['findings']))}", "2. Fix applied: upcast-trainable-fp32",
        f"3. Audit: {findings(len(second['findings']))}"]
    text, page, md = render_text(data), html.unescape(render_html(data)), render_markdown(data)
    for out in (text, page, md):
        assert out.index("1. Audit") < out.index("2. Fix applied") < out.index("3. Audit")
    # the finding that was fixed is still in the story, before the fix
    assert text.index("trainable-low-precision") < text.index("2. Fix applied")


def test_a_history_with_no_finite_value_says_so_instead_of_an_empty_plot():
    nan = {"groups": ["a", "b"], "steps": [0, 1], "grad_norm": [["nan", "inf"], ["nan", "nan"]]}
    doc = document("watch", history=nan)
    chart = view(doc).section("watch").charts[0]
    assert chart.kind == "heatmap" and "non-finite" in chart.empty
    page = render_html(doc)
    assert "gradient-norm heatmap: every gradient norm recorded is non-finite" in html.unescape(page)
    assert 'alt="gradient-norm heatmap"' not in page  # no picture of an empty axis
    assert "every gradient norm recorded is non-finite" in render_text(doc)
    finite = document("watch", history={**nan, "grad_norm": [[1.0, "nan"], [2.0, 3.0]]})
    assert not view(finite).section("watch").charts[0].empty
    assert 'alt="gradient-norm heatmap"' in render_html(finite)


def test_the_palette_is_one_definition_for_matplotlib_and_the_view():
    from nbguard.document import palette
    from nbguard.render import heatmap

    assert heatmap.NAN_COLOR == palette.NAN_COLOR and heatmap.SKIP_COLOR == palette.SKIP_COLOR
    shown = view(document("audit", findings=[])).palette
    assert shown["nan"] == palette.NAN_COLOR and shown["scale"] == list(palette.SCALE)


def test_a_series_with_no_finite_value_is_labelled_not_left_blank():
    from nbguard.render.series import nonfinite_caption, series_png

    assert nonfinite_caption("loss", 6, 0) == "every loss recorded is non-finite (NaN/Inf): nothing to plot"
    assert nonfinite_caption("loss", 1, 5) == "non-finite at 1 step (vermillion lines)"
    assert nonfinite_caption("loss", 0, 6) == ""
    history = {"groups": ["a"], "steps": list(range(6)), "grad_norm": [[1.0] * 6], "loss": ["nan"] * 6}
    assert series_png(history).startswith(b"\x89PNG")  # drawn, with the sentence, not an error


def test_the_probe_view_shows_backward_gradients_when_the_probe_read_them():
    modules = [{"module": "mlp.down_proj", "dtype": "float16", "absmax": 100.0, "input_absmax": 10.0, "headroom": 655.0,
                "grad_absmax": "inf", "grad_headroom": 0.0},
               {"module": "lm_head", "dtype": "float16", "absmax": 5.0, "input_absmax": 1.0, "headroom": 13100.0,
                "grad_absmax": 2.0, "grad_headroom": 32752.0}]
    section = view(document("audit", probe={"limit": 65504.0, "modules": modules})).section("probe")
    assert "gradient abs-max" in section.table.columns
    assert section.table.rows[0][4] == "Inf ⚠ over limit" and section.table.bad_rows == [0]
    assert any(f.text == "backward: 0 modules with gradients at or over the limit, 1 with inf/NaN gradients" for f in section.facts)
    forward_only = [{k: v for k, v in m.items() if not k.startswith("grad")} for m in modules]
    plain = view(document("audit", probe={"limit": 65504.0, "modules": forward_only})).section("probe")
    assert "gradient abs-max" not in plain.table.columns and plain.table.bad_rows == []
