"""cache-eval-crash: "'HybridCache' object has no attribute 'float'".

The crash is real in transformers 4.50 (tests marked ``tf450``, run in that lane): a bf16 Gemma 3
trained with bf16 mixed precision and evaluation during training. On current transformers the
model's cache carries no dtype, so the rule stays silent (main-lane test).
"""
from __future__ import annotations

import pytest
import torch
from audit_helpers import make_args, make_trainer

import nbguard
import nbguard.fixes
from nbguard.auditor.rules.cache import accelerate_converts_dtype_objects
from nbguard.testing import tiny_gemma3, tiny_llama


def _gemma_trainer(tmp_path, dtype=torch.bfloat16, **args):
    options = dict(bf16=True, eval_strategy="steps", eval_steps=1, max_steps=2)
    options.update(args)
    return make_trainer(tiny_gemma3(dtype=dtype), make_args(tmp_path, **options))


def test_accelerate_feature_probe_matches_its_source():
    # accelerate's convert_to_fp32 decides "is a tensor" by hasattr(x, "dtype"): the feature the rule needs.
    import inspect

    from accelerate.utils import operations

    assert accelerate_converts_dtype_objects() == ('hasattr(tensor, "dtype")' in inspect.getsource(operations))


def test_silent_on_current_transformers(tmp_path):
    from nbguard.environment import parsed_version

    if (parsed_version("transformers").major, parsed_version("transformers").minor) == (4, 50):
        pytest.skip("this is the negative case for releases without the bug")
    trainer = _gemma_trainer(tmp_path)
    result = nbguard.audit(trainer=trainer, hardware="a100")
    assert "cache-eval-crash" not in result
    trainer.train()  # and indeed training with evaluation works here


@pytest.mark.tf450
def test_flagged_on_450_and_the_real_crash(tmp_path):
    trainer = _gemma_trainer(tmp_path)
    f = nbguard.audit(trainer=trainer, hardware="a100").finding("cache-eval-crash")
    assert f is not None and f.severity.value == "error"
    assert f.evidence["cache_classes"] == ["HybridCache"] and f.evidence["transformers"].startswith("4.50")
    assert f.evidence["eval_strategy"] == "steps" and f.evidence["embedding_dtype"] == "bfloat16"
    assert f.fixes == ["disable-use-cache"]
    with pytest.raises(AttributeError, match="'HybridCache' object has no attribute 'float'"):
        trainer.train()


@pytest.mark.tf450
def test_training_completes_after_disable_use_cache_on_450(tmp_path):
    trainer = _gemma_trainer(tmp_path)
    changed = nbguard.fixes.apply("disable-use-cache", trainer=trainer).changed
    assert changed == {"config.use_cache": "True -> False"}
    assert "cache-eval-crash" not in nbguard.audit(trainer=trainer, hardware="a100")
    output = trainer.train()
    assert output.global_step == 2
    assert any("eval_loss" in log for log in trainer.state.log_history)


@pytest.mark.tf450
def test_cell_fixes_it_too_on_450(tmp_path):
    trainer = _gemma_trainer(tmp_path)
    exec(nbguard.fixes.code("disable-use-cache", trainer="trainer"), {"trainer": trainer})
    assert "cache-eval-crash" not in nbguard.audit(trainer=trainer, hardware="a100")
    trainer.train()


@pytest.mark.tf450
@pytest.mark.parametrize("case", ["no-eval", "fp32-weights", "llama"])
def test_silent_where_it_cannot_happen_on_450(tmp_path, case):
    if case == "no-eval":
        trainer = _gemma_trainer(tmp_path, eval_strategy="no")
    elif case == "fp32-weights":  # the cache takes the embeddings' dtype: fp32, which accelerate leaves alone
        trainer = _gemma_trainer(tmp_path, dtype=torch.float32)
    else:  # Llama builds a DynamicCache, which carries no dtype
        trainer = make_trainer(tiny_llama(dtype=torch.bfloat16),
                               make_args(tmp_path, bf16=True, eval_strategy="steps", eval_steps=1, max_steps=2))
    assert "cache-eval-crash" not in nbguard.audit(trainer=trainer, hardware="a100")
    trainer.train()  # and indeed it trains and evaluates
