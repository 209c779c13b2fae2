"""Every place that switches a user's model to train or eval mode for a moment puts each module's own flag back."""
from __future__ import annotations

import pytest
import torch

from nbguard.auditor.export import logits_of
from nbguard.introspect.modes import in_eval_mode, in_training_mode, modes_restored
from nbguard.testing import tiny_llama


def _user_model():
    """Training, with one decoder layer the user keeps in eval (as a frozen tower or dropout turned off)."""
    model = tiny_llama(attention_dropout=0.1)
    model.train()
    model.model.layers[0].eval()
    return model


def _flags(model: torch.nn.Module) -> dict[str, bool]:
    return {name: m.training for name, m in model.named_modules()}


def test_eval_and_training_mode_set_every_module_then_put_each_ones_own_flag_back():
    model = _user_model()
    before = _flags(model)
    with in_eval_mode(model):
        assert not any(_flags(model).values())
    assert _flags(model) == before and not model.model.layers[0].training
    with in_training_mode(model):
        assert all(_flags(model).values())
    assert _flags(model) == before


def test_the_flags_come_back_when_the_block_raises():
    model = _user_model()
    before = _flags(model)
    with pytest.raises(RuntimeError, match="the forward failed"), modes_restored(model):
        model.eval()
        raise RuntimeError("the forward failed")
    assert _flags(model) == before


def test_the_export_check_leaves_a_submodule_the_user_keeps_in_eval_in_eval():
    model = _user_model()
    before = _flags(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))
    logits = logits_of(model, [{"input_ids": ids, "attention_mask": torch.ones_like(ids)}], model.config.vocab_size)
    assert logits[0].shape == (2, 6, model.config.vocab_size)
    # (model.train(was_training) afterwards would have switched layer 0 to train mode, its dropout on)
    assert _flags(model) == before
