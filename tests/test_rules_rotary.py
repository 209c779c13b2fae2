"""Issue 43 item 3 (a): rotary layers whose cached inv_freq is not what the config implies, and a RoPE override that
replaced the checkpoint's rope_theta. Real tiny Qwen2/Llama/Gemma 3 models built from configs; the stale case is
shown to matter (the saved and reloaded model computes other logits) and to clear once the layer is rebuilt."""
from __future__ import annotations

import pytest
import torch

import nbguard
from nbguard.testing import tiny_gemma3, tiny_llama, tiny_qwen2

STALE, CHECKPOINT, IGNORED = "rotary-frequencies-stale", "rope-theta-differs-from-checkpoint", "rope-theta-ignored"


def rules(model) -> dict:
    return {f.rule: f for f in nbguard.audit(model).findings if f.rule in (STALE, CHECKPOINT, IGNORED)}


def test_rope_theta_edited_after_build_is_named_with_its_size_and_matters_after_reload(tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny_qwen2(rope_theta=1e6).eval()
    ids = torch.randint(3, 128, (1, 64))
    with torch.no_grad():
        before = model(ids).logits
    model.config.rope_parameters["rope_theta"] = 1e4  # the edit changes nothing in the live model...
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)
    model.save_pretrained(tmp_path)  # ...but the saved config does
    with torch.no_grad():
        assert (AutoModelForCausalLM.from_pretrained(tmp_path)(ids).logits - before).abs().max() > 1e-3

    found = rules(model)[STALE]
    assert found.severity.value == "error"
    (layer,) = found.evidence["layers"]
    assert layer["module"] == "model.rotary_emb" and layer["rope_type"] == "default"
    assert layer["max_abs_difference"] == pytest.approx(0.138, abs=1e-3)
    assert layer["theta_of_cached"] == pytest.approx(1e6, rel=1e-4)
    assert layer["theta_of_config"] == pytest.approx(1e4, rel=1e-4)
    assert "model.rotary_emb" in found.title

    model.model.rotary_emb = type(model.model.rotary_emb)(model.config)  # the remedy the finding names
    assert STALE not in rules(model)


def test_scaling_override_the_layer_never_saw_is_stale():
    model = tiny_qwen2(rope_theta=1e6)
    model.config.rope_parameters = {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}
    (layer,) = rules(model)[STALE].evidence["layers"]
    assert layer["rope_type"] == "linear" and layer["max_abs_difference"] == pytest.approx(0.5)


def test_override_that_drops_rope_theta_is_named():
    model = tiny_qwen2(rope_theta=1e6)
    model.config.rope_parameters = {"rope_type": "linear", "factor": 2.0}  # transformers 5 replaces the whole dict
    found = rules(model)[STALE]
    assert "config_error" in found.evidence["layers"][0] and "rope_theta" in found.detail


def test_per_layer_type_rotary_is_compared_per_type():
    model = tiny_gemma3()
    model.config.rope_parameters["sliding_attention"]["rope_theta"] = 5e5
    (layer,) = rules(model)[STALE].evidence["layers"]
    assert layer["layer_type"] == "sliding_attention" and layer["theta_of_cached"] == pytest.approx(1e4, rel=1e-4)


@pytest.mark.parametrize("build", [
    lambda: tiny_qwen2(rope_theta=1e6),
    lambda: tiny_qwen2(dtype=torch.bfloat16),  # inv_freq rounded to bf16 is not a difference
    lambda: tiny_llama(dtype=torch.float16, rope_theta=5e5, hidden_size=256, num_attention_heads=2),  # subnormals
    tiny_gemma3,
    lambda: tiny_llama(rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5,
                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 64}),
    lambda: tiny_llama(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 5e5}),
], ids=["qwen2", "bf16", "fp16-head-128", "gemma3", "llama3-scaling", "yarn"])
def test_healthy_rotary_layers_stay_quiet(build):
    assert rules(build()) == {}


def test_dynamic_scaling_after_a_long_forward_stays_quiet():
    model = tiny_qwen2(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6})
    with torch.no_grad():
        model(torch.randint(3, 128, (1, 300)))  # beyond max_position_embeddings: inv_freq rescaled at run time
    assert rules(model) == {}


def test_checkpoint_loaded_with_an_override_at_another_base_is_named(tmp_path):
    from transformers import AutoModelForCausalLM

    tiny_qwen2(rope_theta=1e6).save_pretrained(tmp_path)
    overridden = AutoModelForCausalLM.from_pretrained(
        tmp_path, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4})
    found = rules(overridden)[CHECKPOINT]
    assert found.evidence["saved_rope_theta"] == 1e6 and found.evidence["config_rope_theta"] == 1e4
    assert STALE not in rules(overridden)  # built from the override: consistent with itself, wrong for the weights

    assert rules(AutoModelForCausalLM.from_pretrained(tmp_path)) == {}
    repeated = AutoModelForCausalLM.from_pretrained(
        tmp_path, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6})
    assert rules(repeated) == {}


def test_rope_theta_set_the_4x_way_is_named_as_ignored(tmp_path):
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)
    config.rope_theta = 5e5  # transformers 4.x read this; 5 reads rope_parameters only
    model = AutoModelForCausalLM.from_config(config)
    assert model.model.rotary_emb.inv_freq[1] == pytest.approx(1e4 ** (-2 / 16))  # built at the default base
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(reloaded.model.rotary_emb.inv_freq, model.model.rotary_emb.inv_freq)  # still ignored
    for m in (model, reloaded):
        found = {f.rule: f for f in nbguard.audit(m).findings}
        assert found[IGNORED].evidence == {"rope_theta_attribute": 5e5, "rope_parameters_theta": 1e4}
        assert STALE not in found
    assert IGNORED not in {f.rule for f in nbguard.audit(tiny_qwen2(rope_theta=5e5)).findings}  # the constructor
