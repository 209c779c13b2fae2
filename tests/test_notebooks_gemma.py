"""The Gemma 3 notebooks (fp16 on a T4; HybridCache on transformers 4.50) and fp16 padding without packing,
executed headless."""
from __future__ import annotations

import pytest
from notebook_run_helpers import _docs, _events, _not_in_tf450_lane, _origins, _rules, _text, execute  # noqa: F401  (execute: the fixture)

pytestmark = pytest.mark.notebooks


def test_gemma3_fp16_t4(execute):
    _not_in_tf450_lane()
    nb, out = execute("01_gemma3_fp16_t4.ipynb")
    assert "fp16-overflow-risk" in _rules(_docs(nb, "before-fix", "audit"), ("error",))
    events = _events(_docs(nb, "before-fix", "watch"))
    assert events and events[0]["kind"] == "nonfinite-loss" and events[0]["cause"] == "overflow"
    assert _origins(events)[0] == "model.layers.1.mlp"
    compiled = _events(_docs(nb, "before-fix", "compiled"))
    assert _origins(compiled)[0] == "model.layers.1.mlp"  # the user's name, compiled or not
    assert "CompiledFunctionBackward" in "".join(
        o.get("text", "") for c in nb.cells for o in c.get("outputs", []) if "detect_anomaly" in c.source)
    assert _rules(_docs(nb, "after-fix", "audit"), ("error",)) == set()
    assert _events(_docs(nb, "after-fix", "watch")) == []
    assert (out / "01_gemma3_fp16_t4.html").is_file()


def test_padding_without_packing(execute):
    _not_in_tf450_lane()
    nb, out = execute("04_fp16_padding_without_packing.ipynb")
    assert "no-supervised-tokens" in _rules(_docs(nb, "before-fix", "audit"), ("error",))
    events = _events(_docs(nb, "before-fix", "watch"))
    assert events and events[0]["cause"] == "no-supervised-tokens"
    assert "nan" in _text(nb, "before-fix", "watch")                   # the logged grad norm
    assert "no-supervised-tokens" not in _rules(_docs(nb, "after-fix", "audit"))
    assert _events(_docs(nb, "after-fix", "watch")) == []
    assert "nan" not in _text(nb, "after-fix", "watch").split("logged (loss, grad_norm):")[1].split("\n")[0]
    assert (out / "04_fp16_padding_without_packing.html").is_file()


@pytest.mark.tf450
def test_gemma3_hybridcache_tf450(execute):
    nb, out = execute("05_gemma3_hybridcache_tf450.ipynb")
    assert "cache-eval-crash" in _rules(_docs(nb, "before-fix", "audit"), ("error",))
    diagnoses = [d for doc in _docs(nb, "before-fix", "diagnosis") for d in doc.get("diagnoses", [])]
    assert diagnoses and "disable-use-cache" in diagnoses[0]["fixes"]
    assert "has no attribute 'float'" in diagnoses[0]["exception"]
    assert "cache-eval-crash" not in _rules(_docs(nb, "after-fix", "audit"))
    assert "eval losses: [" in _text(nb, "after-fix", "run")
    assert (out / "05_gemma3_hybridcache_tf450.html").is_file()
