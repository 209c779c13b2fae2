"""The watch verifies the fixes of its first localised event on a shadow of the failing step."""
from __future__ import annotations

import pytest
import torch
from verify_helpers import fp16_overflow_run, peft_trainer, peft_zero_embeddings, verdicts
from watch_helpers import PoisonedSiLU, batches, scale_output_to, train

import nbguard
from nbguard.testing import tiny_batch, tiny_llama
from nbguard.verifier import AUTO_MAX_STEP_RUNS, Verification

torch.set_num_threads(1)


def test_peft_zero_embeddings_fp32_adapters_not_enough_embedding_init_verified():
    trainer = peft_trainer(peft_zero_embeddings())
    with nbguard.watch(trainer, policy="skip") as watch:
        trainer.train()
    event = watch.events[0]
    assert event.kind == "nonfinite-grad" and event.origins[0].phase == "backward"
    auto = watch.verification
    assert isinstance(auto, Verification) and event.evidence["verification"] == auto.to_dict()
    assert verdicts(auto)["init-new-embeddings"] == "verified"
    assert verdicts(auto)["upcast-trainable-fp32"] == "not enough"
    assert auto.verdicts[0].fix == "init-new-embeddings"  # verified first
    upcast = auto.verdict("upcast-trainable-fp32")
    assert upcast.step.grads_finite is False and "float32" in upcast.step.precision
    assert upcast.step.first_nonfinite.startswith("gradient: ") and upcast.step.nonfinite_grads
    init = auto.verdict("init-new-embeddings")
    assert init.step.grads_finite and init.step.total_grad_norm > 0 and init.step.loss == init.step.loss
    assert "_w[_zero] = _w[_trained].float().mean(dim=0)" in init.code  # the exact cell that was verified
    assert init.changes  # which tensors the shadow replaced
    # the step runs later fixes were bounded out of; a manual verify runs them all
    manual = nbguard.verify(event)
    assert manual.baseline is not None and not manual.baseline.healthy
    got = verdicts(manual)
    assert got["init-new-embeddings"] == "verified"
    assert got["upcast-trainable-fp32"] == "not enough"
    assert got["switch-precision"] == "not enough"  # fp32 everywhere: the gradient passes fp32's range too
    assert got["enable-grad-clipping"] == "not enough"
    assert got["lower-learning-rate"] == "not checked"
    assert [v.verdict for v in manual.verdicts] == sorted((v.verdict for v in manual.verdicts),
                                                          key=["verified", "not enough", "not checked"].index)


def test_fp16_overflow_bf16_verified_module_level_names_the_ranges():
    model, _, watch = fp16_overflow_run()
    v = watch.verification
    assert v.module_check.module == "model.layers.1.mlp.up_proj"
    assert v.module_check.fits == {"float16": False, "bfloat16": True, "float32": True}
    assert "overflows fp16, fits bf16 and fp32" in v.module_check.summary
    switch = v.verdict("switch-precision")
    assert switch.verdict == "verified" and switch.options == {"to": "bf16"}
    assert switch.module.finite and switch.module.dtype == "bfloat16"
    assert "bfloat16" in switch.step.precision
    clip = v.verdict("enable-grad-clipping")
    assert clip.verdict == "not enough" and clip.step.first_nonfinite == "forward: model.layers.1.mlp.up_proj"
    assert not clip.module.finite
    # fixes with nothing to change on this fp32 model are not run, and say so
    assert v.verdict("upcast-trainable-fp32").verdict == "not checked"
    assert "changes nothing" in v.verdict("upcast-trainable-fp32").reason
    assert "switch-precision" in str(v) and "[verified]" in str(v)


def test_verify_false_turns_automatic_verification_off():
    _, _, watch = fp16_overflow_run(verify=False)
    event = watch.events[0]
    assert watch.verification is None and "verification" not in event.evidence
    with pytest.raises(ValueError, match="not captured"):
        nbguard.verify(event)
    with pytest.raises(TypeError, match="verify must be True or False"):
        nbguard.watch(tiny_llama(), optimizer=torch.optim.SGD(tiny_llama().parameters(), lr=0.1), verify="yes")


def test_a_nan_made_in_backward_has_no_fix_that_verifies():
    model = tiny_llama()
    model.model.layers[0].mlp.act_fn = PoisonedSiLU()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with nbguard.watch(model, optimizer=opt, policy="skip") as watch:
        train(model, opt, batches(1))
    assert watch.events[0].cause == "invalid-op"
    v = nbguard.verify(watch.events[0])
    assert v.verified == []
    assert v.verdict("enable-grad-clipping").verdict == "not enough"
    assert v.verdict("switch-precision").verdict == "not checked"  # fp32 already: nothing to change


def test_automatic_verification_is_bounded_and_only_for_the_first_event():
    trainer = peft_trainer(peft_zero_embeddings(), steps=3)
    with nbguard.watch(trainer, policy="skip") as watch:
        trainer.train()
    bad = [e for e in watch.events if e.kind in ("nonfinite-loss", "nonfinite-grad")]
    assert len(bad) == 1 and bad[0].evidence["consecutive_bad_steps"] == 3
    runs = [v for v in watch.verification.verdicts if v.step is not None]
    assert 0 < len(runs) <= AUTO_MAX_STEP_RUNS
    assert any("bound" in v.reason for v in watch.verification.verdicts if v.verdict == "not checked")


def _accumulated(empty_second: bool, overflow_first: bool):
    model = tiny_llama()
    data = batches(2)
    if empty_second:
        data[1]["labels"][:] = -100
    if overflow_first:
        scale_output_to(model, model.model.layers[1].mlp.up_proj, data[0], 2e5)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with nbguard.watch(model, optimizer=opt, policy="skip") as watch:
        train(model, opt, data, accumulation=2, autocast=torch.float16 if overflow_first else None)
    return watch


def test_data_fix_is_verified_on_the_corrected_batch():
    watch = _accumulated(empty_second=True, overflow_first=False)
    event = watch.events[0]
    assert event.cause == "no-supervised-tokens"
    # a plain loop: the watch offers no Trainer data fix; asked for by name, its plan still runs on the step
    assert "drop-unsupervised-rows" not in [x.fix for x in watch.verification.verdicts]
    v = nbguard.verify(event, fix_id="drop-unsupervised-rows").verdict("drop-unsupervised-rows")
    assert v.verdict == "verified" and v.step.micro_batches == 1  # the empty micro-batch is dropped
    assert v.step.supervised_tokens == 2 * 11 and "over 22 supervised tokens" in v.reason
    assert v.changes == {"rows dropped": 2} and "filter" in v.code


def test_data_fix_that_leaves_no_data_is_not_verified():
    """An all -100 step (a truncation that cut every answer): dropping its rows leaves nothing to train on."""
    model = tiny_llama()
    data = batches(1)
    data[0]["labels"][:] = -100
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with nbguard.watch(model, optimizer=opt, policy="skip") as watch:
        train(model, opt, data)
    assert watch.events[0].cause == "no-supervised-tokens"
    v = nbguard.verify(watch.events[0], fix_id="drop-unsupervised-rows")
    verdict = v.verdict("drop-unsupervised-rows")
    assert verdict.verdict == "not enough" and "no data is left" in verdict.reason
    assert verdict.step.micro_batches == 0 and verdict.code is not None and "filter" in verdict.code
    nbguard.fixes.get("drop-unsupervised-rows")  # the id the verdict names is a registered fix


def test_data_fix_is_not_enough_when_the_rest_of_the_step_overflows():
    watch = _accumulated(empty_second=True, overflow_first=True)
    v = nbguard.verify(watch.events[0], fix_id="drop-unsupervised-rows").verdict("drop-unsupervised-rows")
    assert v.verdict == "not enough" and v.step.first_nonfinite == "forward: model.layers.1.mlp.up_proj"


def test_data_fix_changes_nothing_on_a_batch_with_labels_everywhere():
    _, _, watch = fp16_overflow_run()
    v = nbguard.verify(watch.events[0], fix_id="drop-unsupervised-rows")
    assert [x.fix for x in v.verdicts] == ["drop-unsupervised-rows"]
    assert v.verdicts[0].verdict == "not checked" and "changes nothing" in v.verdicts[0].reason


def test_a_step_over_the_memory_budget_is_not_checked_with_the_reason():
    _, _, watch = fp16_overflow_run()
    v = nbguard.verify(watch.events[0], memory_budget=10_000)
    assert not v.step_level and "budget" in v.step_skipped and v.baseline is None
    switch = v.verdict("switch-precision")
    assert switch.verdict == "not checked" and switch.step is None and "budget" in switch.reason
    assert switch.module.finite  # the module level still ran: the origin fits bf16
    clip = v.verdict("enable-grad-clipping")
    assert clip.verdict == "not enough" and "still non-finite" in clip.reason  # the origin overflows under it
    assert v.memory["estimate"]["total"] > v.memory["budget"] == 10_000
    big = nbguard.verify(watch.events[0], memory_budget=10e9)
    assert big.step_level and big.verdict("switch-precision").verdict == "verified"


def test_verify_refuses_a_step_whose_weights_moved_since():
    model = tiny_llama()
    data = batches(2)
    scale_output_to(model, model.model.layers[1].mlp.up_proj, data[0], 2e5)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with nbguard.watch(model, optimizer=opt, policy="warn") as watch:  # warn: the NaN update is applied
        train(model, opt, data[:1], autocast=torch.float16)
    assert watch.verification.verdict("switch-precision").verdict == "verified"  # made before the update
    with pytest.raises(ValueError, match="weights changed since step 0"):
        nbguard.verify(watch.events[0])


def test_bad_arguments_are_named():
    _, _, watch = fp16_overflow_run()
    with pytest.raises(ValueError, match="unknown fix id 'no-such-fix'"):
        nbguard.verify(watch.events[0], fix_id="no-such-fix")
    with pytest.raises(ValueError, match="memory_budget must be a positive number"):
        nbguard.verify(watch.events[0], memory_budget=-1)
    with pytest.raises(TypeError, match="Event or an audit Finding"):
        nbguard.verify(tiny_batch())


def test_a_gradscaler_skip_streak_is_verified_too():
    from nbguard.verifier import auto_verify
    from nbguard.watcher import NanWatch, WatchSettings

    model = tiny_llama()
    data = batches(3)
    scale_output_to(model, model.model.layers[0].mlp.up_proj, data[0], 2e5)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    settings = WatchSettings(skip_streak=2)
    with NanWatch(model, optimizer=opt, scaler=scaler, settings=settings, verifier=auto_verify) as watch:
        train(model, opt, data, scaler=scaler, autocast=torch.float16)
    # the first skipped step is the localised one (a scaler-skip event): its step is the one verified
    [event] = [e for e in watch.events if "verification" in e.evidence]
    assert event.kind == "scaler-skip" and event.step == 0 and event.cause == "overflow"
    assert event.evidence["verification"] == watch.verification.to_dict()
    assert any(e.kind == "skipped-steps" for e in watch.events)
    assert watch.verification.verdict("switch-precision").verdict == "verified"
    assert watch.verification.verdict("enable-grad-clipping").verdict == "not enough"


def test_attention_implementation_is_switched_for_the_shadow_only():
    model = tiny_llama(attn_implementation="sdpa")
    model.model.layers[0].mlp.act_fn = PoisonedSiLU()  # NaN born in backward: attention is not the cause
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with nbguard.watch(model, optimizer=opt, policy="skip") as watch:
        train(model, opt, batches(1))
    seen = []
    handle = model.model.layers[1].self_attn.register_forward_hook(
        lambda m, a, o: seen.append(m.config._attn_implementation))
    try:
        v = nbguard.verify(watch.events[0], fix_id="set-attn-implementation",
                           options={"set-attn-implementation": {"to": "eager"}})
    finally:
        handle.remove()
    assert seen == ["sdpa", "eager"]  # the baseline as it ran, then the fix
    [verdict] = v.verdicts
    assert verdict.verdict == "not enough" and verdict.changes == {"config._attn_implementation": "sdpa -> eager"}
    assert model.config._attn_implementation == "sdpa"


def test_pad_right_is_verified_on_the_batch_padded_on_the_right():
    model = tiny_llama()
    model.model.layers[0].mlp.act_fn = PoisonedSiLU()  # a failing step to run the corrected batch on
    batch = tiny_batch(2, 12)
    for key, value in (("input_ids", 0), ("attention_mask", 0), ("labels", -100)):
        batch[key][1, :4] = value  # row 1 padded on the left
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with nbguard.watch(model, optimizer=opt, policy="skip") as watch:
        train(model, opt, [batch])
    seen = []
    handle = model.model.embed_tokens.register_forward_hook(lambda m, a, o: seen.append(a[0].clone()))
    try:
        v = nbguard.verify(watch.events[0], fix_id="pad-right-for-training")
    finally:
        handle.remove()
    [verdict] = v.verdicts
    assert verdict.changes == {"rows re-padded on the right": 1}
    baseline_ids, fixed_ids = seen
    assert torch.equal(baseline_ids, batch["input_ids"])
    assert torch.equal(fixed_ids[1, :8], batch["input_ids"][1, 4:]) and (fixed_ids[1, 8:] == 0).all()
    assert torch.equal(fixed_ids[0], batch["input_ids"][0])
    assert verdict.verdict == "not enough"  # the NaN comes from the poisoned backward, not the padding
    assert 'padding_side = "right"' in verdict.code


def test_pad_right_changes_nothing_on_a_batch_without_left_padding():
    _, _, watch = fp16_overflow_run()
    [verdict] = nbguard.verify(watch.events[0], fix_id="pad-right-for-training").verdicts
    assert verdict.verdict == "not checked" and "changes nothing" in verdict.reason


def test_the_partial_fp32_variant_is_not_passed_off_as_the_full_switch():
    _, _, watch = fp16_overflow_run()
    v = nbguard.verify(watch.events[0], fix_id="switch-precision",
                       options={"switch-precision": {"to": "fp32", "only": ["model.layers.1.mlp.up_proj"]}})
    [verdict] = v.verdicts
    assert verdict.verdict == "not checked" and "partial variant" in verdict.reason


def test_every_verification_reaches_the_session_timeline():
    from nbguard.session import SESSION, latest_verdict

    _, _, watch = fp16_overflow_run()
    # the automatic verification travels in the watch's own entry (its event's evidence), once
    assert SESSION.verifications == []
    verdict = watch.verification.verdict("switch-precision")
    assert latest_verdict("switch-precision", verdict.code).label == verdict.verdict
    assert latest_verdict("switch-precision", verdict.code + "\n") is None  # another text: no verdict borrowed
    v = nbguard.verify(watch.events[0], fix_id="enable-grad-clipping")  # an explicit one is an entry of its own
    [doc] = SESSION.verifications
    assert doc["verification"]["subject"] == v.subject
    assert doc["verification"]["verdicts"][0]["fix"] == "enable-grad-clipping"
