"""MoE routers trained without the load-balancing loss: tiny Mixtral / Qwen2-MoE built from configs."""
from __future__ import annotations

import pytest
import torch

import nbguard
from nbguard.testing import TINY_VOCAB, tiny_batch


def tiny_mixtral(**overrides):
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=TINY_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                        **overrides)
    return MixtralForCausalLM(cfg)


def tiny_qwen2_moe():
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(0)
    return Qwen2MoeForCausalLM(Qwen2MoeConfig(
        vocab_size=TINY_VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        num_experts=4, num_experts_per_tok=2))


def router_findings(model):
    return [f for f in nbguard.audit(model).findings if f.rule == "moe-router-without-aux-loss"]


def router_grad(model) -> torch.Tensor:
    batch = tiny_batch(batch_size=2, seq_len=12)
    model.zero_grad()
    model(**batch).loss.backward()
    return model.model.layers[0].mlp.gate.weight.grad.clone()


def test_full_finetune_without_router_logits_is_flagged_and_the_router_gets_no_balancing_gradient():
    model = tiny_mixtral()
    (f,) = router_findings(model)
    assert f.evidence["trainable_router_params"]["first"] == ["model.layers.0.mlp.gate.weight"]
    assert f.evidence["router_aux_loss_coef"] == model.config.router_aux_loss_coef
    without = router_grad(model)
    assert nbguard.fixes.apply("enable-router-aux-loss", model=model).changed
    with_aux = router_grad(model)
    assert not torch.allclose(without, with_aux)  # the load-balancing term now reaches the router
    assert not router_findings(model)


def test_qwen2_moe_router_is_recognised():
    (f,) = router_findings(tiny_qwen2_moe())
    assert f.evidence["trainable_router_params"]["first"] == ["model.layers.0.mlp.gate.weight"]


def test_lora_on_attention_keeps_routers_frozen_and_stays_quiet():
    from peft import LoraConfig, get_peft_model

    assert not router_findings(get_peft_model(tiny_mixtral(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"])))


def test_lora_with_router_in_modules_to_save_is_flagged_and_freezing_fixes_it():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_mixtral(), LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["gate"]))
    (f,) = router_findings(model)
    assert f.evidence["peft"] is True and "modules_to_save" in f.evidence["trainable_router_params"]["first"][0]
    assert nbguard.fixes.apply("freeze-moe-router", model=model).changed
    assert not router_findings(model)


def test_router_logits_on_stays_quiet():
    assert not router_findings(tiny_mixtral(output_router_logits=True))


@pytest.mark.parametrize("fix", ["enable-router-aux-loss", "freeze-moe-router"])
def test_fix_cells_compile(fix):
    compile(nbguard.fixes.code(fix, model="moe"), "<cell>", "exec")
