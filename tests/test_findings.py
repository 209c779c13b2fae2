import json
import math

import pytest

from nbguard.findings import (
    MIME_TYPE,
    SCHEMA_VERSION,
    Event,
    Finding,
    Origin,
    Severity,
    decode_float,
    document,
    encode_float,
    jsonable,
)


def test_non_finite_floats_survive_json():
    for value in (1.5, float("nan"), float("inf"), float("-inf"), None):
        encoded = encode_float(value)
        round_tripped = decode_float(json.loads(json.dumps(encoded, allow_nan=False)))
        if value is None:
            assert round_tripped is None
        elif math.isnan(value):
            assert math.isnan(round_tripped)
        else:
            assert round_tripped == value


def test_finding_round_trips_and_validates_severity():
    finding = Finding(
        rule="trainable-low-precision",
        severity="warning",
        title="Trainable parameters in bf16",
        detail="Adam updates underflow in bf16.",
        evidence={"params": [("lora_A", "torch.bfloat16")], "absmax": float("inf")},
        fixes=["upcast-trainable-fp32"],
    )
    assert finding.severity is Severity.WARNING
    data = json.loads(json.dumps(finding.to_dict(), allow_nan=False))
    assert data["evidence"] == {"params": [["lora_A", "torch.bfloat16"]], "absmax": "inf"}
    again = Finding.from_dict(data)
    assert again.rule == finding.rule and again.severity is Severity.WARNING
    with pytest.raises(ValueError):
        Finding(rule="x", severity="fatal", title="", detail="")


def test_event_with_origins_round_trips():
    event = Event(
        kind="nonfinite-grad",
        step=3,
        message="NaN gradient",
        cause="overflow",
        origins=[Origin(module="model.layers.0.mlp", phase="forward", dtype="torch.float16",
                        input_absmax=12.0, output_absmax=float("inf"), micro_batch=2)],
    )
    data = json.loads(json.dumps(event.to_dict(), allow_nan=False))
    again = Event.from_dict(data)
    assert again.origin("forward").output_absmax == math.inf
    assert again.origin("forward").micro_batch == 2
    assert again.origin("backward") is None


def test_event_rejects_unknown_kind_and_cause():
    with pytest.raises(ValueError, match="unknown event kind"):
        Event(kind="explosion", step=0, message="")
    with pytest.raises(ValueError, match="unknown cause"):
        Event(kind="nonfinite-loss", step=0, message="", cause="gremlins")


def test_document_envelope():
    doc = document("audit", findings=[])
    assert doc["schema_version"] == SCHEMA_VERSION and doc["kind"] == "audit"
    assert MIME_TYPE == "application/vnd.nbguard.v1+json"


def test_jsonable_handles_dtypes_and_nesting():
    import torch

    assert jsonable({"dtype": torch.float16, "shape": (2, 3), 1: {float("nan")}}) == {
        "dtype": "torch.float16", "shape": [2, 3], "1": ["nan"],
    }


def test_plain_import_is_light_and_fixes_reachable():
    import subprocess
    import sys

    code = (
        "import sys, nbguard; assert 'torch' not in sys.modules, 'import nbguard must not load torch'; "
        "assert callable(nbguard.fixes.apply); print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"
