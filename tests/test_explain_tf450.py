"""The real HybridCache crash (transformers 4.50 lane): traceback, diagnosis card, Apply, training completes."""
from __future__ import annotations

import pytest
from notebook_helpers import WIDGET_MIME, run, shell  # noqa: F401

pytestmark = pytest.mark.tf450


def test_hybridcache_crash_explained_and_fixed_from_the_card(shell, tmp_path):
    run(shell, f"""
import torch
from transformers import Trainer, TrainingArguments
from nbguard.testing import tiny_gemma3, TinyDataset
trainer = Trainer(model=tiny_gemma3(dtype=torch.bfloat16), train_dataset=TinyDataset(8), eval_dataset=TinyDataset(4),
                  args=TrainingArguments(output_dir={str(tmp_path)!r}, use_cpu=True, bf16=True, report_to=[],
                                         eval_strategy="steps", eval_steps=1, max_steps=2, save_strategy="no",
                                         per_device_train_batch_size=2, per_device_eval_batch_size=2,
                                         disable_tqdm=True))
""")
    cell = run(shell, "trainer.train()")
    assert isinstance(cell.error, AttributeError)
    assert "'HybridCache' object has no attribute 'float'" in cell.stdout  # the normal traceback
    [doc] = cell.docs
    assert doc["diagnoses"][0]["signature"] == "cache-float-crash"
    code = doc["fix_cells"]["disable-use-cache"]["code"]  # the model's config and its text config, by the notebook's name
    assert "for _config in (trainer.model.config, trainer.model.config.get_text_config()):" in code
    assert "_config.use_cache = False" in code
    assert WIDGET_MIME in cell.outputs[0]

    from nbguard.notebook.present import OPEN_VIEWS

    OPEN_VIEWS[-1].fix_row("disable-use-cache").apply_button.click()
    assert shell.user_ns["trainer"].model.config.use_cache is False
    cell = run(shell, "out = trainer.train()")
    assert cell.error is None and shell.user_ns["out"].global_step == 2
