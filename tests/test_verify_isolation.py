"""Verification never touches the user's weights, gradients, optimizer state, RNG or module attributes."""
from __future__ import annotations

import torch
from verify_helpers import assert_same, chat_batch, everything, peft_zero_embeddings, verdicts
from watch_helpers import batches, scale_output_to, train

import nbguard
from nbguard import fixes
from nbguard.testing import tiny_batch, tiny_llama

torch.set_num_threads(1)


def _peft_loop_event():
    """A plain loop on the PEFT reproduction: one healthy step (optimizer state), then the failing one."""
    model = peft_zero_embeddings()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    train(model, opt, [tiny_batch(4, 16)])  # token ids below the new rows: healthy, fills AdamW's moments
    with nbguard.watch(model, optimizer=opt, policy="skip") as watch:
        train(model, opt, [chat_batch()])
    return model, opt, watch


def test_every_fix_leaves_every_piece_of_user_state_bit_identical():
    model, opt, watch = _peft_loop_event()
    event = watch.events[0]
    assert verdicts(watch.verification)["init-new-embeddings"] == "verified"
    model(**tiny_batch(2, 16)).loss.backward()  # gradients the user has in hand
    model.config.use_cache = True
    torch.manual_seed(123)
    before = everything(model, opt)
    for fix_id in fixes.available():
        nbguard.verify(event, fix_id=fix_id)
        assert_same(before, everything(model, opt))
    full = nbguard.verify(event)
    assert_same(before, everything(model, opt))
    assert verdicts(full)["init-new-embeddings"] == "verified"
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_gradient_checkpointing_and_eval_flags_are_restored():
    model = tiny_llama(attention_dropout=0.1)
    data = batches(1)
    scale_output_to(model, model.model.layers[1].mlp.up_proj, data[0], 2e5)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with nbguard.watch(model, optimizer=opt, policy="skip") as watch:
        train(model, opt, data, autocast=torch.float16)
    model.model.layers[0].self_attn.eval()  # a submodule the user has in eval mode
    before = everything(model, opt)
    v = nbguard.verify(watch.events[0])
    assert v.verdict("switch-precision").verdict == "verified"
    assert_same(before, everything(model, opt))
    assert model.model.layers[0].gradient_checkpointing is True and model.model.layers[0].self_attn.training is False


def _run(verify: bool):
    """Two steps with dropout; the first overflows in fp16 (policy warn: its update is applied)."""
    model = tiny_llama(attention_dropout=0.2)
    data = batches(2)
    scale_output_to(model, model.model.layers[1].mlp.up_proj, data[0], 2e5)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(7)
    with nbguard.watch(model, optimizer=opt, policy="warn", verify=verify) as watch:
        losses = train(model, opt, data, autocast=torch.float16)
    return model, opt, watch, losses


def test_automatic_verification_leaves_the_training_run_bit_identical():
    on_model, on_opt, on_watch, on_losses = _run(True)
    off_model, off_opt, off_watch, off_losses = _run(False)
    assert on_watch.verification is not None and off_watch.verification is None
    assert on_watch.verification.verdict("switch-precision").step is not None  # the shadow really ran
    assert_same(everything(off_model, off_opt, identity=False), everything(on_model, on_opt, identity=False))
    assert [torch.isnan(x).item() or x.item() for x in on_losses] == [torch.isnan(x).item() or x.item()
                                                                       for x in off_losses]


def test_a_4bit_layers_compute_dtype_is_switched_for_the_shadow_and_restored(tmp_path):
    """Real bitsandbytes Linear4bit (CPU backend): its fp16 compute overflows; bf16 compute is verified."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from nbguard import Finding

    data = batches(1)
    plain = tiny_llama()
    scale_output_to(plain, plain.model.layers[1].mlp.up_proj, data[0], 2e5)
    plain.save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(
        tmp_path, device_map="cpu",
        quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float16))
    for name, p in model.named_parameters():
        p.requires_grad_(p.is_floating_point() and "norm" in name)
    layers = {n: m for n, m in model.named_modules() if type(m).__name__ == "Linear4bit"}
    assert layers and all(m.compute_dtype == torch.float16 for m in layers.values())
    before = everything(model)
    finding = Finding("bnb-compute-dtype", "error", "fp16 compute", "", fixes=["switch-precision"])
    v = nbguard.verify(finding, model=model, batch=data[0])
    assert v.baseline.first_nonfinite == "forward: model.layers.1.mlp.up_proj"
    switch = v.verdict("switch-precision")
    assert switch.verdict == "verified" and switch.options == {"to": "bf16"}
    assert switch.changes["model.layers.1.mlp.up_proj.compute_dtype"] == "float16 -> bfloat16"
    assert all(m.compute_dtype == torch.float16 for m in layers.values())
    assert_same(before, everything(model))


def test_the_shadow_runs_each_module_in_the_mode_the_step_ran_in():
    from nbguard.step.capture import MicroBatch, capture_rng
    from nbguard.verifier.shadow import CapturedStep, ShadowPlan, run_step

    model = tiny_llama(attention_dropout=0.5)
    attn = model.model.layers[0].self_attn
    attn.eval()  # the user keeps this one's dropout off
    step = CapturedStep(model, [MicroBatch(0, (), tiny_batch(), capture_rng(), [])])
    attn.train()  # ...and changes it after the step was captured
    model.model.layers[1].eval()
    seen = []
    handle = attn.register_forward_hook(lambda m, a, o: seen.append((m.training, model.model.layers[1].training)))
    try:
        evidence = run_step(step, ShadowPlan())
    finally:
        handle.remove()
    assert seen == [(False, True)] and evidence.healthy
    assert attn.training is True and model.model.layers[1].training is False  # put back as the user left them


def test_switch_precision_under_a_trainer_lifts_its_accelerators_autocast_for_the_shadow_only(tmp_path):
    """A bf16 Trainer wraps forward in autocast (accelerate): the fp32 shadow must run without it."""
    from audit_helpers import make_args, make_trainer
    from watch_helpers import PoisonedSiLU

    model = tiny_llama()
    model.model.layers[0].mlp.act_fn = PoisonedSiLU()  # a NaN born in backward: some step to verify
    trainer = make_trainer(model, make_args(tmp_path, bf16=True, max_steps=1))
    with nbguard.watch(trainer, policy="skip") as watch:
        trainer.train()
    wrapper = vars(trainer.model)["forward"]
    assert trainer.model._original_forward is not wrapper
    dtypes = []
    handle = model.model.layers[1].mlp.down_proj.register_forward_hook(lambda m, a, out: dtypes.append(out.dtype))
    try:
        v = nbguard.verify(watch.events[0], fix_id="switch-precision", options={"switch-precision": {"to": "fp32"}})
    finally:
        handle.remove()
    assert dtypes == [torch.bfloat16, torch.float32]  # the baseline as the step ran (wrapper), then the fp32 fix
    assert v.baseline.first_nonfinite is not None
    assert v.verdicts[0].changes["accelerator autocast"] == "off" and v.verdicts[0].verdict == "not enough"
    assert vars(trainer.model)["forward"] is wrapper  # the Trainer's forward is put back
