"""Weights that never loaded: a checkpoint whose keys were renamed loads as a random model."""
from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file, save_file
from watch_helpers import batches

import nbguard
from nbguard.testing import TINY_VOCAB, tiny_llama

torch.set_num_threads(1)


def loaded_findings(model, batch):
    return [f for f in nbguard.audit(model, batch=batch).findings if f.rule == "weights-not-loaded"]


def trained_checkpoint(folder, steps: int = 30):
    """A tiny Llama trained a few steps (its loss well below ln(vocab)), saved as a pretrained checkpoint."""
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = batches(2)
    for step in range(steps):
        model(**data[step % 2]).loss.backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(folder)
    return data[0]


def test_renamed_keys_leave_a_random_model_and_the_audit_names_them(tmp_path):
    from transformers import AutoModelForCausalLM

    batch = trained_checkpoint(tmp_path)
    [file] = tmp_path.glob("*.safetensors")
    tensors = load_file(file)
    renamed = {k.replace("model.", "backbone.", 1): v for k, v in tensors.items()}  # another prefix
    save_file(renamed, file, metadata={"format": "pt"})
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert info["missing_keys"]  # what transformers itself says, only when asked
    [f] = loaded_findings(model, batch)
    ev = f.evidence
    assert f.severity.value == "error"
    assert ev["loss"] == pytest.approx(math.log(TINY_VOCAB), rel=0.05) and ev["vocab_size"] == TINY_VOCAB
    assert ev["keys_compared"] and set(ev["missing_keys"]["first"]) <= set(info["missing_keys"])
    assert ev["missing_keys"]["count"] == len(info["missing_keys"]) and "model.embed_tokens.weight" in \
        info["missing_keys"]
    assert ev["unexpected_keys"]["count"] == len(renamed) - 1  # every renamed key but the untouched lm_head
    assert "model.embed_tokens.weight" in f.detail or ev["missing_keys"]["first"][0] in f.detail


def test_a_correctly_loaded_trained_model_is_quiet(tmp_path):
    from transformers import AutoModelForCausalLM

    batch = trained_checkpoint(tmp_path)
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"]
    with torch.no_grad():
        assert float(model(**batch).loss) < 0.8 * math.log(TINY_VOCAB)  # it learned: far from uniform
    assert loaded_findings(model, batch) == []


def test_a_model_built_from_its_config_is_random_on_purpose_and_quiet():
    model = tiny_llama()
    batch = batches(1)[0]
    with torch.no_grad():
        assert float(model(**batch).loss) == pytest.approx(math.log(TINY_VOCAB), rel=0.05)
    assert loaded_findings(model, batch) == []


def test_a_random_checkpoint_that_loads_every_key_is_quiet(tmp_path):
    """Flat, but the loader found every weight: the checkpoint is random, not the loading."""
    from transformers import AutoModelForCausalLM

    tiny_llama().save_pretrained(tmp_path)
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    batch = batches(1)[0]
    assert not info["missing_keys"]
    with torch.no_grad():
        assert float(model(**batch).loss) == pytest.approx(math.log(TINY_VOCAB), rel=0.05)
    assert loaded_findings(model, batch) == []
