"""The zero-embedding notebooks (PEFT in bf16; QLoRA on real 4-bit layers), executed headless."""
from __future__ import annotations

import pytest
from notebook_run_helpers import _docs, _events, _no_errors, _not_in_tf450_lane, _origins, _rules, _text, execute  # noqa: F401  (execute: the fixture)

pytestmark = pytest.mark.notebooks


def test_peft_zero_embeddings_bf16(execute):
    _not_in_tf450_lane()
    nb, out = execute("02_peft_zero_embeddings_bf16.ipynb")
    assert {"zero-embedding-rows", "trainable-low-precision"} <= _rules(_docs(nb, "before-fix", "audit"))
    events = _events(_docs(nb, "before-fix", "watch"))
    assert events and events[0]["kind"] in ("nonfinite-grad", "nonfinite-loss")
    # the gradient overflow is born in an RMSNorm's backward at the zero hidden state
    assert any(m.endswith("layernorm") or m.endswith("norm") for m in _origins(events, "backward"))
    # the fixes run on the failing step: fp32 adapters alone are not enough, the embedding init is verified
    [verification] = [d["verification"] for d in _docs(nb, "before-fix", "verification")]
    got = {v["fix"]: v["verdict"] for v in verification["verdicts"]}
    assert got["init-new-embeddings"] == "verified" and got["upcast-trainable-fp32"] == "not enough"
    assert events[0]["evidence"]["verification"]["verdicts"][0]["fix"] == "init-new-embeddings"
    assert _rules(_docs(nb, "after-fix", "audit")) & {"zero-embedding-rows", "trainable-low-precision"} == set()
    assert _events(_docs(nb, "after-fix", "watch")) == []
    assert "nan" not in _text(nb, "after-fix", "watch").split("logged (loss, grad_norm):")[1].split("\n")[0]
    # before shipping: the merge is checked against the model trained; the tie (Gemma 3's lm_head is the
    # input embedding) spoils any merge, the bf16 weights add their rounding, and no merge fix is offered
    for tag, bf16 in (("bf16-merge", True), ("fp32-merge", False)):
        [merge] = [f for d in _docs(nb, "export", tag) for f in d["findings"] if f["rule"] == "export-merge-differs"]
        assert merge["evidence"]["merge"]["shared_weight"] and merge["fixes"] == [], tag
        assert ("bfloat16" in merge["detail"]) is bf16, tag
    assert (out / "02_peft_zero_embeddings_bf16.html").is_file()


def test_qlora_4bit_zero_embeddings(execute):
    """Seed (b) on real bitsandbytes nf4 layers: caught, explained, fixed."""
    _not_in_tf450_lane()
    nb, out = execute("06_qlora_4bit_zero_embeddings.ipynb")
    _no_errors(nb)
    before = _docs(nb, "before-fix", "audit")
    assert {"zero-embedding-rows", "trainable-low-precision"} <= _rules(before)
    quantization = before[0]["stack"]["quantization"]
    assert quantization["layers_4bit"] == 70 and quantization["quant_types"] == {"nf4": 70}
    assert quantization["compute_dtypes"] == {"bfloat16": 70} and quantization["lora_on_4bit"] == 20
    events = _events(_docs(nb, "before-fix", "watch"))
    assert events and events[0]["kind"] in ("nonfinite-grad", "nonfinite-loss")
    assert any(m.endswith("layernorm") or m.endswith("norm") for m in _origins(events, "backward"))
    assert "nan" in _text(nb, "before-fix", "watch").split("logged (loss, grad_norm):")[1].split("\n")[0]
    assert _rules(_docs(nb, "after-fix", "audit")) & {"zero-embedding-rows", "trainable-low-precision"} == set()
    assert _events(_docs(nb, "after-fix", "watch")) == []
    assert "nan" not in _text(nb, "after-fix", "watch").split("logged (loss, grad_norm):")[1].split("\n")[0]
    assert (out / "06_qlora_4bit_zero_embeddings.html").is_file()
