"""The exception explainer: each signature rule on the REAL exception where this machine can raise it."""
from __future__ import annotations

import pytest
import torch

import nbguard
from nbguard import fixes
from nbguard.explainer import RULES, diagnose
from nbguard.session import SESSION


def raised(func) -> BaseException:
    try:
        func()
    except BaseException as exc:  # noqa: BLE001 - we want whatever the library raises
        return exc
    raise AssertionError("expected an exception")


def anomaly_nan():
    with torch.autograd.detect_anomaly():
        x = torch.tensor([0.0], requires_grad=True)
        (torch.sqrt(x) * 0).sum().backward()  # d sqrt at 0 is inf, times 0 -> NaN


def compiled_anomaly_nan():
    fn = torch.compile(lambda x: torch.sqrt(x) * 0, backend="aot_eager")
    with torch.autograd.detect_anomaly():
        x = torch.tensor([0.0], requires_grad=True)
        fn(x).sum().backward()


def unscale_fp16():
    p = torch.nn.Parameter(torch.randn(3).half())
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale((p.float() * 1).sum()).backward()
    scaler.unscale_(opt)


def dtype_mismatch():
    torch.nn.functional.linear(torch.randn(2, 3), torch.randn(4, 3).to(torch.bfloat16))


def no_grad():
    torch.randn(2, 3).sum().backward()


def bf16_on_this_machine():
    from transformers import TrainingArguments

    TrainingArguments(output_dir="/tmp/nbguard-explain", bf16=True, use_cpu=False, report_to=[])


def multinomial_nan():
    torch.multinomial(torch.tensor([float("nan"), 1.0]), 1)


def hybrid_cache_float():
    class HybridCache:  # the attribute lookup Python performs on transformers 4.50's cache object
        pass

    HybridCache().float()


def deepspeed_loss_scale():
    # DeepSpeed's fp16 optimizer raises exactly this (deepspeed/runtime/fp16/loss_scaler.py); not installed here
    raise Exception("Current loss scale already at minimum - cannot decrease scale anymore. Exiting run.")


def watch_stop():
    from nbguard.testing import tiny_batch, tiny_llama

    model = tiny_llama()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nbguard.watch(model, optimizer=opt, policy="stop"):
        with torch.no_grad():
            model.model.layers[0].mlp.up_proj.weight[0, 0] = float("inf")
        opt.zero_grad()
        model(**tiny_batch()).loss.backward()
        opt.step()


REAL = {
    "anomaly-nan-output": anomaly_nan,
    "cache-float-crash": hybrid_cache_float,
    "fp16-unscale-error": unscale_fp16,
    "matmul-dtype-mismatch": dtype_mismatch,
    "no-grad-input": no_grad,
    "bf16-unsupported": bf16_on_this_machine,
    "sampling-nonfinite-probs": multinomial_nan,
    "loss-scale-minimum": deepspeed_loss_scale,
    "nbguard-stopped": watch_stop,
}
EXPECTED_FIXES = {
    "cache-float-crash": ["disable-use-cache"],
    "fp16-unscale-error": ["upcast-trainable-fp32"],
    "no-grad-input": ["enable-input-require-grads"],
    "bf16-unsupported": ["switch-precision"],
}


def test_every_rule_has_a_real_case():
    from test_explain_signatures import CASES  # issue 13's signatures, tested in their own file
    from test_rules_data_signatures import DATA_CASES  # issue 21's, likewise

    assert set(REAL) | set(CASES) | set(DATA_CASES) == set(RULES)


@pytest.mark.parametrize("signature", sorted(REAL))
def test_rule_recognises_the_real_error(signature):
    exc = raised(REAL[signature])
    diagnosis = diagnose(exc)
    assert diagnosis is not None, f"{type(exc).__name__}: {exc}"
    assert diagnosis.signature == signature
    assert diagnosis.exception.startswith(type(exc).__name__)
    if signature in EXPECTED_FIXES:
        assert diagnosis.fixes == EXPECTED_FIXES[signature]


@pytest.mark.parametrize("signature", sorted(REAL))
def test_rule_is_silent_on_other_errors(signature):
    others = [raised(REAL[s]) for s in REAL if s != signature]
    others += [raised(lambda: 1 / 0), raised(lambda: torch.ones(2) @ torch.ones(3)),
               AttributeError("'DynamicCache' object has no attribute 'floaty'"),
               RuntimeError("Function 'SqrtBackward0' returned inf values in its 0th output.")]
    rule = RULES[signature]
    for exc in others:
        assert rule(exc) is None, f"{signature} fired on {type(exc).__name__}: {exc}"


def test_unknown_error_gives_none():
    assert nbguard.explain(raised(lambda: {}["missing"])) is None


def test_anomaly_evidence_names_function_and_output():
    d = diagnose(raised(anomaly_nan))
    assert d.evidence == {"function": "SqrtBackward0", "output_index": 0, "compiled": False}
    assert "nbguard.watch" in d.detail


def test_compiled_backward_points_to_replay_localisation():
    d = diagnose(raised(compiled_anomaly_nan))
    assert d is not None and d.evidence["function"] == "CompiledFunctionBackward"
    assert d.evidence["compiled"] is True
    assert "torch.compile" in d.detail and "replays" in d.detail


def test_dtype_mismatch_names_the_dtypes():
    d = diagnose(raised(dtype_mismatch))
    assert d.evidence["dtypes"] == ["float32", "bfloat16"]


def test_explain_looks_through_the_exception_chain():
    def wrapped():
        try:
            no_grad()
        except RuntimeError as inner:
            raise ValueError("training step failed") from inner

    def handled_context():
        try:
            unscale_fp16()
        except ValueError:
            raise KeyError("while logging")  # noqa: B904 - the implicit context is the point

    assert diagnose(raised(wrapped)).signature == "no-grad-input"
    assert diagnose(raised(handled_context)).signature == "fp16-unscale-error"


def test_explain_records_the_diagnosis_for_the_report():
    before = len(SESSION.diagnoses)
    d = nbguard.explain(raised(multinomial_nan))
    assert SESSION.diagnoses[before:] == [d]


def test_explain_rejects_non_exceptions():
    with pytest.raises(TypeError, match="exception instance"):
        nbguard.explain("RuntimeError: boom")


def test_every_fix_offered_exists_and_renders_with_user_names():
    for signature, make in REAL.items():
        d = diagnose(raised(make))
        for fix_id in d.fixes:
            assert fix_id in fixes.available(), (signature, fix_id)
        doc = d.to_document(names={"trainer": "my_trainer"})
        assert doc["kind"] == "diagnosis" and doc["diagnoses"][0]["signature"] == signature
        assert set(doc["fix_cells"]) == set(d.fixes)
        for cell in doc["fix_cells"].values():
            assert "my_trainer" in cell["code"], cell["code"]
        model_only = d.to_document(names={"model": "my_model"})["fix_cells"]
        # no invented TrainingArguments or optimizer name: those fixes get no cell when only a model is named
        needs_args = {f for f in d.fixes if fixes.get(f).needs in ("args", "optimizer", "args-or-optimizer")}
        assert set(model_only) == set(d.fixes) - needs_args
        for cell in model_only.values():
            assert "my_model" in cell["code"], cell["code"]


def test_diagnosis_displays_with_text_and_html_fallbacks():
    bundle = diagnose(raised(unscale_fp16))._repr_mimebundle_()
    assert {"text/plain", "text/html", "application/vnd.nbguard.v1+json"} <= set(bundle)
    assert "fp16-unscale-error" in bundle["text/plain"] or "FP16" in bundle["text/plain"]
    assert "upcast-trainable-fp32" in bundle["text/html"]


def test_stop_policy_error_names_the_origin():
    exc = raised(watch_stop)
    d = diagnose(exc)
    assert d.evidence["step"] == 0 and d.evidence["origin"]["module"] == exc.event.origins[0].module
    assert exc.event.origins[0].module in d.title


def test_bf16_unsupported_switches_to_fp32():
    d = diagnose(raised(bf16_on_this_machine))
    assert d.fix_options["switch-precision"] == {"to": "fp32"}
