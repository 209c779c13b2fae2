"""LoRA on MoE models whose experts are fused 3-D parameters (transformers v5): target_modules that name the
expert projections can leave the experts without an adapter, frozen (peft#3009); target_parameters reaches them.

Real objects only: tiny Mixtral / PhiMoE / Qwen3-MoE / Llama built from configs, real get_peft_model, a real
optimizer step for the fix.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

import nbguard
from nbguard.testing import TINY_VOCAB, tiny_batch, tiny_llama

torch.set_num_threads(1)

RULE = "moe-experts-not-adapted"
FIX = "lora-target-fused-experts"
LLAMA_NAMES = ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]
FUSED = ["model.layers.0.mlp.experts.down_proj", "model.layers.0.mlp.experts.gate_up_proj",
         "model.layers.1.mlp.experts.down_proj", "model.layers.1.mlp.experts.gate_up_proj"]
COMMON = dict(vocab_size=TINY_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2)


def tiny_mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    return MixtralForCausalLM(MixtralConfig(num_local_experts=4, **COMMON))


def tiny_phimoe():
    from transformers import PhimoeConfig, PhimoeForCausalLM

    torch.manual_seed(0)
    return PhimoeForCausalLM(PhimoeConfig(num_local_experts=4, **COMMON))


def tiny_qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(num_experts=4, moe_intermediate_size=64, **COMMON))


def lora(model, **options):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, **options))


def findings(model):
    return [f for f in nbguard.audit(model).findings if f.rule == RULE]


def expert_adapter_params(model):
    """LoRA weights that sit on the experts (a ParamWrapper around the experts module)."""
    return {n: p for n, p in model.named_parameters() if ".experts." in n and "lora_" in n}


def expert_base_params(model):
    return {n: p for n, p in model.named_parameters() if p.dim() == 3 and ".experts." in n}


def test_mixtral_with_llama_names_fires_naming_every_fused_expert():
    model = lora(tiny_mixtral(), target_modules=LLAMA_NAMES)
    # the mechanism, read independently of nbguard: no adapter on the experts, and they do not train
    assert not expert_adapter_params(model)
    base = expert_base_params(model)
    assert len(base) == 4 and not any(p.requires_grad for p in base.values())
    [f] = findings(model)
    assert f.severity.value == "warning"
    assert sorted(f.evidence["frozen_expert_params"]["first"]) == FUSED
    assert f.evidence["frozen_expert_params"]["count"] == 4
    assert f.evidence["frozen_expert_elements"] == sum(p.numel() for p in base.values())
    assert f.evidence["target_modules_naming_experts"] == ["down_proj", "gate_proj", "up_proj"]
    assert f.evidence["target_parameters_to_add"] == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
    assert f.evidence["expert_classes"] == ["MixtralExperts"]
    assert f.evidence["peft_has_target_parameters"] is True
    assert "not as nn.Linear" in f.detail and "peft#3009" in f.detail and "target_parameters=" in f.detail
    assert f.fixes == [FIX]


def test_model_type_outside_peft_name_mapping_fires_for_w1_w2_w3():
    """PhiMoE's experts are fused like Mixtral's, but PEFT maps w1/w2/w3 to them only for Mixtral-like types."""
    model = lora(tiny_phimoe(), target_modules=["q_proj", "w1", "w2", "w3"])
    assert not expert_adapter_params(model)
    [f] = findings(model)
    assert f.evidence["target_modules_naming_experts"] == ["w1", "w2", "w3"]
    assert sorted(f.evidence["frozen_expert_params"]["first"]) == FUSED


def test_dense_llama_with_the_same_names_is_quiet():
    model = lora(tiny_llama(), target_modules=LLAMA_NAMES)
    assert any("mlp.down_proj.lora_B" in n for n, p in model.named_parameters() if p.requires_grad)
    assert not findings(model)


def test_target_parameters_covering_the_experts_is_quiet():
    model = lora(tiny_mixtral(), target_modules=LLAMA_NAMES,
                 target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    assert len(expert_adapter_params(model)) == 8  # A and B on two parameters in two layers
    assert not findings(model)


def test_target_parameters_covering_half_the_experts_fires_for_the_other_half():
    model = lora(tiny_mixtral(), target_modules=LLAMA_NAMES, target_parameters=["mlp.experts.gate_up_proj"])
    [f] = findings(model)
    assert sorted(f.evidence["frozen_expert_params"]["first"]) == [n for n in FUSED if n.endswith("down_proj")]


def test_names_the_installed_peft_maps_to_the_experts_are_quiet():
    """PEFT 0.21 rewrites Mixtral's w1/w2/w3 and Qwen3-MoE's gate/up/down into target_parameters itself."""
    for model in (lora(tiny_mixtral(), target_modules=["w1", "w2", "w3"]),
                  lora(tiny_qwen3_moe(), target_modules=["gate_proj", "up_proj", "down_proj"])):
        assert len(expert_adapter_params(model)) == 8
        assert not findings(model)


def test_attention_only_adapter_is_quiet():
    """q_proj/v_proj only: the user never named the experts; an attention adapter is a choice, not this mistake."""
    model = lora(tiny_mixtral(), target_modules=["q_proj", "v_proj"])
    assert not expert_adapter_params(model)
    assert not findings(model)


def test_every_attention_projection_named_is_quiet():
    """q/k/v/o are all of Mixtral's Linear modules: still a deliberate attention adapter, not "all-linear"."""
    model = lora(tiny_mixtral(), target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    assert not expert_adapter_params(model)
    assert not findings(model)


def test_full_fine_tuning_is_quiet():
    assert not findings(tiny_mixtral())


def test_peft_without_target_parameters_names_the_release_and_offers_no_fix():
    """A LoraConfig class without target_parameters (PEFT < 0.17), its other fields as the real config's."""
    model = lora(tiny_mixtral(), target_modules=LLAMA_NAMES)
    real = model.peft_config["default"]
    model.peft_config["default"] = SimpleNamespace(target_modules=real.target_modules)
    [f] = findings(model)
    assert f.fixes == [] and f.evidence["peft_has_target_parameters"] is False
    assert "PEFT >= 0.17.0" in f.detail


def one_step(model):
    """A real training step: AdamW over what trains, on a tiny batch. Returns the loss and the gradients."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    loss = model(**tiny_batch(batch_size=2, seq_len=12)).loss
    loss.backward()
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    opt.step()
    opt.zero_grad()
    return loss.item(), grads


def test_fix_puts_lora_on_the_experts_and_a_real_step_trains_them():
    model = lora(tiny_mixtral(), target_modules=LLAMA_NAMES)
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    with torch.no_grad():
        q.lora_B["default"].weight.fill_(0.25)  # the adapters already there must keep their weights
    q_a = q.lora_A["default"].weight.detach().clone()
    base_before = {n.replace(".base_layer", ""): p.detach().clone() for n, p in expert_base_params(model).items()}

    result = nbguard.fixes.apply(FIX, model=model)
    assert result.changed and "mlp.experts.gate_up_proj" in result.changed["target_parameters"]
    assert model.peft_config["default"].target_parameters == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
    assert set(model.peft_config["default"].target_modules) == set(LLAMA_NAMES)
    assert torch.equal(q.lora_A["default"].weight, q_a) and bool((q.lora_B["default"].weight == 0.25).all())
    assert not findings(model)
    assert not nbguard.fixes.apply(FIX, model=model).changed  # idempotent

    adapters = expert_adapter_params(model)
    assert len(adapters) == 8 and all(p.requires_grad for p in adapters.values())
    before = {n: p.detach().clone() for n, p in adapters.items()}
    loss, grads = one_step(model)
    assert math.isfinite(loss)
    # at init lora_B is zero, so only B has a gradient on the first step; every B on the experts must have one
    b_grads = {n: grads[n] for n in adapters if "lora_B" in n}
    assert len(b_grads) == 4 and all(g is not None and g.abs().sum() > 0 for g in b_grads.values())
    assert all(not torch.equal(before[n], p) for n, p in adapters.items() if "lora_B" in n)
    # the experts' own weights stay frozen and unchanged
    base_after = {n.replace(".base_layer", ""): p for n, p in expert_base_params(model).items()}
    assert base_after.keys() == base_before.keys()
    assert all(not p.requires_grad and torch.equal(p, base_before[n]) for n, p in base_after.items())


def test_without_the_fix_the_step_leaves_the_experts_untouched():
    model = lora(tiny_mixtral(), target_modules=LLAMA_NAMES)
    loss, grads = one_step(model)
    assert math.isfinite(loss) and not any(".experts." in n for n in grads)


def test_fix_cell_does_what_apply_does():
    model = lora(tiny_mixtral(), target_modules=LLAMA_NAMES)
    cell = nbguard.fixes.code(FIX, model="moe_model")
    exec(compile(cell, "<cell>", "exec"), {"moe_model": model})
    assert len(expert_adapter_params(model)) == 8
    assert model.peft_config["default"].target_parameters == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
    assert not findings(model)
    assert any(".lora_B." in n and "q_proj" in n for n, p in model.named_parameters() if p.requires_grad)


def test_verdict_is_not_checked_with_the_reason():
    model = lora(tiny_mixtral(), target_modules=LLAMA_NAMES)
    [f] = findings(model)
    verdict = nbguard.verify(f, model=model, batch=tiny_batch(batch_size=2, seq_len=12)).verdict(FIX)
    assert verdict.verdict == "not checked"
    assert "adds adapter modules" in verdict.reason
    assert not expert_adapter_params(model)  # verifying never changed the user's model


def test_all_linear_fires_where_peft_leaves_the_experts_out():
    """"all-linear" meant every Linear, experts included, under transformers v4; PhiMoE's fused experts get none."""
    model = lora(tiny_phimoe(), target_modules="all-linear")
    assert not expert_adapter_params(model)
    [f] = findings(model)
    assert f.evidence["target_modules_naming_experts"] == ["all-linear"]


def test_fix_keeps_modules_to_save_training():
    model = lora(tiny_mixtral(), target_modules=LLAMA_NAMES, modules_to_save=["lm_head"])
    saved = {n for n, p in model.named_parameters() if p.requires_grad and "modules_to_save" in n}
    assert saved
    nbguard.fixes.apply(FIX, model=model)
    assert saved <= {n for n, p in model.named_parameters() if p.requires_grad}
    assert len(expert_adapter_params(model)) == 8
