"""Planted faults on tiny real models: the watch names the exact origin of each."""
import math

import pytest
import torch
from watch_helpers import PoisonedSiLU, batches, scale_output_to, train, with_token

import nbguard
from nbguard.testing import tiny_batch, tiny_llama

torch.set_num_threads(1)


def _one_event(watch, kind=None):
    bad = [e for e in watch.events if e.kind != "watch-error"]
    assert [e.kind for e in watch.events if e.kind == "watch-error"] == []
    assert len(bad) == 1, watch.summary()
    if kind:
        assert bad[0].kind == kind
    return bad[0]


@pytest.mark.parametrize("precision", ["autocast", "half"])
def test_fp16_overflow_in_a_linear_names_that_linear(precision):
    model = tiny_llama()
    data = batches(3)
    scale_output_to(model, model.model.layers[1].mlp.up_proj, data[0], 2e5)
    if precision == "half":  # a pure fp16 model: CPU matmuls in fp16 work in torch 2.x
        model.half()
    assert all(torch.isfinite(p).all() for p in model.parameters())  # the weights themselves fit fp16
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with nbguard.watch(model, optimizer=opt) as watch:
        train(model, opt, data[:1], autocast=torch.float16 if precision == "autocast" else None)
    event = _one_event(watch, "nonfinite-loss")
    assert event.step == 0 and event.cause == "overflow"
    origin = event.origin("forward")
    assert origin.module == "model.layers.1.mlp.up_proj"
    assert origin.dtype == "float16" and origin.output_absmax == math.inf
    assert math.isfinite(origin.input_absmax) and origin.micro_batch == 0


def test_overflow_between_two_mlp_children_names_the_mlp_with_down_proj_as_evidence():
    model = tiny_llama()
    data = batches(1)
    mlp = model.model.layers[0].mlp
    # gate and up stay well inside fp16 (5e3), their product does not
    scale_output_to(model, mlp.gate_proj, data[0], 5e3)
    scale_output_to(model, mlp.up_proj, data[0], 5e3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with nbguard.watch(model, optimizer=opt) as watch:
        train(model, opt, data, autocast=torch.float16)
    event = _one_event(watch)
    origin = event.origin("forward")
    assert origin.module == "model.layers.0.mlp"
    assert event.cause == "overflow"
    assert origin.evidence["received_by"] == "model.layers.0.mlp.down_proj"
    assert origin.tensor == "intermediate passed to model.layers.0.mlp.down_proj as args[0]"
    assert origin.output_absmax == math.inf and math.isfinite(origin.input_absmax)


def test_nan_made_in_a_modules_backward_is_found_in_backward():
    model = tiny_llama()
    model.model.layers[1].mlp.act_fn = PoisonedSiLU()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with nbguard.watch(model, optimizer=opt) as watch:
        train(model, opt, batches(1))
    event = _one_event(watch, "nonfinite-grad")
    assert event.origin("forward") is None
    origin = event.origin("backward")
    assert origin.module == "model.layers.1.mlp.act_fn"
    assert event.cause == "invalid-op"
    # the norms were taken per parameter: heads above the fault kept finite gradients
    assert "lm_head" not in event.evidence["nonfinite_groups"]
    assert "model.layers.1.mlp" in event.evidence["nonfinite_groups"]


def test_nan_embedding_row_is_found_on_the_step_whose_batch_hits_it():
    model = tiny_llama()
    with torch.no_grad():
        model.model.embed_tokens.weight[7] = float("nan")
    data = batches(4, avoid=7)
    data[2] = with_token(data[2], 7)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with nbguard.watch(model, optimizer=opt, policy="skip") as watch:
        train(model, opt, data)
    event = _one_event(watch, "nonfinite-loss")
    assert event.step == 2
    assert event.cause == "nonfinite-parameter"
    origin = event.origin("forward")
    assert origin.module == "model.embed_tokens" and origin.tensor == "weight"
    assert watch.history.skipped_steps == [2]


def test_all_labels_ignored_is_no_supervised_tokens_without_a_module():
    model = tiny_llama()
    data = batches(2)
    data[1]["labels"][:] = -100
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with nbguard.watch(model, optimizer=opt) as watch:
        train(model, opt, data)
    event = _one_event(watch, "nonfinite-loss")
    assert event.step == 1 and event.cause == "no-supervised-tokens"
    assert event.origins == []
    assert event.evidence["micro_batches_without_labels"] == [0]


def test_fault_in_the_third_micro_batch_under_accumulation():
    model = tiny_llama()
    with torch.no_grad():
        model.model.embed_tokens.weight[9] = float("nan")
    data = batches(6, avoid=9)
    data[5] = with_token(data[5], 9)  # step 1, micro-batch 2
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with nbguard.watch(model, optimizer=opt) as watch:
        train(model, opt, data, accumulation=3)
    event = _one_event(watch)
    assert event.step == 1 and watch.step == 2
    assert event.evidence["micro_batches"] == 3
    origin = event.origin("forward")
    assert origin.module == "model.embed_tokens" and origin.micro_batch == 2


def test_overflow_under_torch_compile_is_named_in_eager_terms():
    model = tiny_llama()
    data = batches(1)
    scale_output_to(model, model.model.layers[1].self_attn.o_proj, data[0], 2e5)
    compiled = torch.compile(model, backend="aot_eager")
    opt = torch.optim.AdamW(compiled.parameters(), lr=1e-3)
    with nbguard.watch(compiled, optimizer=opt) as watch:
        train(compiled, opt, data, autocast=torch.float16)
    event = _one_event(watch)
    origin = event.origin("forward")
    # the user's names (no torch.compile prefix, never CompiledFunctionBackward), in the event and the heatmap
    assert origin.module == "model.layers.1.self_attn.o_proj"
    assert model.get_submodule(origin.module) is model.model.layers[1].self_attn.o_proj
    assert watch.history.groups and not any("_orig_mod" in g for g in watch.history.groups)
    assert "model.layers.1.self_attn" in watch.history.groups
    assert event.cause == "overflow"


def test_nan_lora_b_weight_in_a_peft_model():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        model.base_model.model.model.layers[1].self_attn.v_proj.lora_B["default"].weight[0, 0] = float("nan")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    with nbguard.watch(model, optimizer=opt) as watch:
        train(model, opt, batches(1))
    event = _one_event(watch)
    assert event.cause == "nonfinite-parameter"
    origin = event.origin("forward")
    assert origin.module == "base_model.model.model.layers.1.self_attn.v_proj.lora_B.default"
    assert dict(model.named_modules())[origin.module] is not None
    assert origin.tensor == "weight"


def test_nan_input_is_nonfinite_input_at_the_model():
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    embeds = torch.randn(2, 8, 64)
    embeds[0, 2, 5] = float("inf")
    with nbguard.watch(model, optimizer=opt) as watch:
        loss = model(inputs_embeds=embeds, labels=tiny_batch(2, 8)["labels"]).loss
        loss.backward()
        opt.step()
    event = _one_event(watch)
    assert event.cause == "nonfinite-input"
    assert event.origin("forward").module == ""


def test_replay_leaves_grads_params_and_rng_untouched():
    model = tiny_llama(attention_dropout=0.5)
    model.model.layers[1].mlp.act_fn = PoisonedSiLU()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    watch = nbguard.watch(model, optimizer=opt, policy="warn")
    seen = {}

    def before_step(optimizer, args, kwargs):  # registered first: runs before the watch's replay
        seen["grads"] = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
        seen["rng"] = torch.get_rng_state()

    opt._optimizer_step_pre_hooks.move_to_end(opt.register_step_pre_hook(before_step).id, last=False)
    after = {}
    opt.register_step_pre_hook(lambda o, a, k: after.update(
        grads=[None if p.grad is None else p.grad.clone() for p in model.parameters()], rng=torch.get_rng_state()))
    train(model, opt, batches(1))
    watch.detach()
    assert watch.events and watch.events[0].origin("backward") is not None
    for g1, g2 in zip(seen["grads"], after["grads"]):
        assert (g1 is None) == (g2 is None)
        if g1 is not None:
            assert torch.equal(g1.isnan(), g2.isnan()) and torch.equal(g1.nan_to_num(), g2.nan_to_num())
    assert torch.equal(seen["rng"], after["rng"])


@pytest.mark.parametrize("fault", ["forward", "backward"])
def test_localisation_under_gradient_checkpointing(fault):
    model = tiny_llama()
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if fault == "backward":
        model.model.layers[1].mlp.act_fn = PoisonedSiLU()
        expected = "model.layers.1.mlp.act_fn"
    else:
        with torch.no_grad():
            model.model.layers[1].mlp.down_proj.weight[0, 0] = float("nan")
        expected = "model.layers.1.mlp.down_proj"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with nbguard.watch(model, optimizer=opt) as watch:
        train(model, opt, batches(1))
    event = _one_event(watch)
    assert event.origin(fault).module == expected


def test_a_failing_replay_keeps_the_event_unlocalised():
    model = tiny_llama()
    model.model.layers[1].mlp.act_fn = PoisonedSiLU()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    watch = nbguard.watch(model, optimizer=opt)

    def out_of_memory(micro_batches):
        raise RuntimeError("simulated out of memory")

    watch._localiser.replayer = type("Broken", (), {"run": staticmethod(out_of_memory)})()
    train(model, opt, batches(1))
    watch.detach()
    event = _one_event(watch, "nonfinite-grad")
    assert event.origins == [] and "simulated out of memory" in event.evidence["replay_error"]


def test_the_replay_leaves_every_module_in_the_mode_the_user_set():
    from watch_helpers import PoisonedSiLU, batches, train

    import nbguard
    from nbguard.testing import tiny_llama

    model = tiny_llama()
    model.model.layers[1].mlp.act_fn = PoisonedSiLU(armed=True)  # a NaN in backward: the step is replayed
    model.model.layers[0].eval()  # the user keeps one block in eval mode while the rest trains
    modes = {name: m.training for name, m in model.named_modules()}
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with nbguard.watch(model, optimizer=opt, policy="skip") as watch:
        train(model, opt, batches(1))
    assert watch.events and watch.events[0].origins  # the replay ran
    assert {name: m.training for name, m in model.named_modules()} == modes
