"""The probe and the watch on real bitsandbytes Linear4bit layers with PEFT LoRA (issue 12 section 1):
an overflow in the 4-bit base layer, in the LoRA branch, and between the two (in the LoRA
wrapper's own sum) are each named apart; the skip policy leaves 8-bit optimizer state untouched."""
from __future__ import annotations

import pytest
import torch
from qlora_helpers import q_proj, qlora, scale_4bit
from watch_helpers import PoisonedSiLU, batches, output_absmax

import nbguard
from nbguard.auditor import run_probe

torch.set_num_threads(1)
PREFIX = "base_model.model.model.layers.0.self_attn.q_proj"


def _fp16_qlora(**lora):
    """A pure fp16 QLoRA model (fp16 norms, fp16 adapters, fp16 compute): values overflow where they are made."""
    return qlora(dtype=torch.float16, adapter_dtype_fp32=False, **lora)


def _base_overflow():
    model = _fp16_qlora()
    data = batches(2)
    wrapper = q_proj(model)
    scale_4bit(wrapper.base_layer, 2e5 / output_absmax(model, wrapper.base_layer, data[0]))
    return model, data


def _lora_overflow():
    model = _fp16_qlora()
    data = batches(2)
    wrapper = q_proj(model)
    lora_a, lora_b = wrapper.lora_A["default"], wrapper.lora_B["default"]
    with torch.no_grad():
        lora_b.weight.normal_()
    # both factors grow by the same amount: each weight stays well inside fp16, the product does not
    factor = (2e5 / output_absmax(model, lora_b, data[0])) ** 0.5
    with torch.no_grad():
        lora_a.weight.mul_(factor)
        lora_b.weight.mul_(factor)
    assert all(torch.isfinite(p).all() for p in model.parameters() if p.is_floating_point())
    return model, data


def _sum_overflow():
    """Base output and LoRA output each ~40000 (finite in fp16), their sum in the wrapper ~80000 (inf)."""
    model = _fp16_qlora(r=64, lora_alpha=64, targets=["q_proj"])  # scaling 1: B @ A can equal the base weight
    data = batches(2)
    wrapper = q_proj(model)
    base = wrapper.base_layer
    scale_4bit(base, 4e4 / output_absmax(model, base, data[0]))
    with torch.no_grad():  # the base layer's own effective weight, whatever packing the CPU backend uses
        weight = base(torch.eye(64, dtype=torch.float16)).float().T
    with torch.no_grad():
        wrapper.lora_A["default"].weight.copy_(torch.eye(64))
        wrapper.lora_B["default"].weight.copy_(weight)
    return model, data


def _train(model, data, policy="warn", optimizer=None):
    opt = optimizer or torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    with nbguard.watch(model, optimizer=opt, policy=policy) as watch:
        for batch in data:
            model(**batch).loss.backward()
            opt.step()
            opt.zero_grad()
    return watch


@pytest.mark.parametrize("plant, origin", [
    (_base_overflow, PREFIX + ".base_layer"),
    (_lora_overflow, PREFIX + ".lora_B.default"),
    (_sum_overflow, PREFIX),
])
def test_the_watch_names_the_4bit_base_layer_the_lora_branch_or_the_sum_between_them(plant, origin):
    model, data = plant()
    watch = _train(model, data)
    event = watch.events[0]
    assert event.kind == "nonfinite-loss" and event.cause == "overflow", watch.summary()
    found = event.origin("forward")
    assert found.module == origin and found.dtype == "float16"
    assert found.evidence["class"] == {PREFIX + ".base_layer": "Linear4bit", PREFIX: "Linear4bit"}.get(
        origin, "Linear")


def test_the_probe_measures_the_base_layer_and_the_lora_branch_apart():
    model, data = _base_overflow()
    probe = run_probe(model, data[0])
    assert probe.absmax(PREFIX + ".base_layer") == float("inf")
    lora = probe.absmax(PREFIX + ".lora_B.default")
    assert lora is not None and lora < 1.0  # LoRA B starts at zero: the branch is not the culprit
    healthy = run_probe(_fp16_qlora(), data[0])
    assert healthy.absmax(PREFIX + ".base_layer") < 100 and healthy.near_limit() == []


def test_a_healthy_qlora_run_is_quiet():
    model = _fp16_qlora()
    watch = _train(model, batches(3))
    assert watch.events == [] and watch.step == 3


@pytest.mark.parametrize("optimizer", ["AdamW8bit", "PagedAdamW8bit"])
def test_skip_policy_leaves_8bit_optimizer_state_untouched(optimizer):
    import bitsandbytes as bnb

    model = qlora(prepare=True, targets=["q_proj", "v_proj", "up_proj"])
    act = model.base_model.model.model.layers[1].mlp.act_fn = PoisonedSiLU(armed=False)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = getattr(bnb.optim, optimizer)(params, lr=1e-3, min_8bit_size=16)  # small enough to be 8-bit here
    data = batches(4)
    snapshots = []
    with pytest.warns(UserWarning) if optimizer.startswith("Paged") else _nothing(), \
            nbguard.watch(model, optimizer=opt, policy="skip") as watch:
        for i, batch in enumerate(data):
            act.armed = i == 2
            model(**batch).loss.backward()
            opt.step()
            opt.zero_grad()
            snapshots.append(({id(p): {k: v.clone() for k, v in opt.state[p].items() if torch.is_tensor(v)}
                               for p in params}, [p.detach().clone() for p in params]))
    assert [e.kind for e in watch.events] == ["nonfinite-grad"] and watch.events[0].step == 2
    assert watch.history.skipped_steps == [2]
    assert any(v.dtype == torch.uint8 for s in snapshots[1][0].values() for v in s.values())  # real 8-bit state
    state_before, weights_before = snapshots[1]
    state_skipped, weights_skipped = snapshots[2]
    for pid, tensors in state_before.items():
        for key, value in tensors.items():
            assert torch.equal(value, state_skipped[pid][key]), key
    assert all(torch.equal(a, b) for a, b in zip(weights_before, weights_skipped))
    assert not all(torch.equal(a, b) for a, b in zip(weights_skipped, snapshots[3][1]))  # training resumed


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def test_trainer_with_paged_adamw_8bit_skips_the_bad_step_and_trains_on(tmp_path):
    from audit_helpers import make_args, make_trainer
    from transformers import TrainerCallback

    model = qlora(prepare=True)
    act = model.base_model.model.model.layers[1].mlp.act_fn = PoisonedSiLU(armed=False)

    class ArmAtStep1(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            act.armed = state.global_step == 1

    trainer = make_trainer(model, make_args(tmp_path, optim="paged_adamw_8bit", max_steps=3,
                                            per_device_train_batch_size=2))
    trainer.add_callback(ArmAtStep1())
    watch = nbguard.watch(trainer, policy="skip")
    with pytest.warns(UserWarning):  # paged optimizers fall back to plain buffers on CPU
        trainer.train()
    watch.detach()
    assert type(watch.optimizer).__module__.startswith("bitsandbytes")  # the real 8-bit optimizer was bound
    assert [e.kind for e in watch.events] == ["nonfinite-grad"] and watch.events[0].step == 1
    assert watch.events[0].origin("backward").module.endswith("layers.1.mlp.act_fn")
    assert watch.history.skipped_steps == [1] and watch.step == 3
    assert all(torch.isfinite(p).all() for p in model.parameters() if p.requires_grad)


def test_the_probe_sees_an_overflow_between_the_base_layer_and_the_lora_branch():
    model, data = _sum_overflow()
    probe = run_probe(model, data[0])
    base, lora = probe.absmax(PREFIX + ".base_layer"), probe.absmax(PREFIX + ".lora_B.default")
    assert base < 65504 and lora < 65504  # each child is finite in fp16
    assert probe.absmax(PREFIX) == float("inf")  # their sum, made in the wrapper's own code, is not
