"""Real TRL trainers (GRPO, RLOO, DPO, KTO) on tiny models, on the CPU, without downloads.

The tokenizer is the word-level one of ``data_helpers`` (words w3..w127, EOS id 2); prompts are a
few words. GRPO/RLOO generate with HF ``generate`` in well under a second per step at this size.
"""
from __future__ import annotations

import copy
import math

import torch

from nbguard.testing import EOS, TINY_VOCAB, tiny_qwen2, word_tokenizer


def prompt_rows(rows: int = 16, words: int = 4, **columns) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(rows):
        ids = torch.randint(3, TINY_VOCAB, (words,), generator=gen).tolist()
        out.append({"prompt": " ".join(f"w{i}" for i in ids), **columns})
    return out


def ending_model(eos_logit: float = 3.0, seed: int = 0):
    """A tiny Qwen2 that ends many of its completions early: its EOS logit is raised by a bias on the
    head, so healthy runs have finished answers (a random tiny model almost never says EOS)."""
    model = tiny_qwen2(seed=seed)
    bias = torch.zeros(TINY_VOCAB)
    bias[EOS] = eos_logit
    model.lm_head.bias = torch.nn.Parameter(bias)
    return model


def length_reward(completions, **kwargs):
    """A healthy reward: closeness to a four-word answer, so completions of one prompt differ in reward."""
    return [-abs(len(c.split()) - 4.0) for c in completions]


def log_match_reward(completions, **kwargs):
    """A log-score reward: log of the count of 'w5' in the completion, -inf when it never appears."""
    return [math.log(c.split().count("w5")) if "w5" in c.split() else -math.inf for c in completions]


def grpo_trainer(tmp_path, reward_funcs=length_reward, model=None, rows: int = 16, rloo: bool = False,
                 reward_processing_classes=None, **overrides):
    """A GRPOTrainer (an RLOOTrainer with ``rloo``) on prompts of four words, four completions each."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

    settings = dict(output_dir=str(tmp_path / ("rloo" if rloo else "grpo")), per_device_train_batch_size=4, num_generations=4,
                    max_completion_length=8, max_steps=6, logging_steps=1, report_to="none", use_cpu=True,
                    learning_rate=1e-3, save_strategy="no", disable_tqdm=True)
    if rloo:
        settings["beta"] = 0.0  # no reference model (TRL would load one from the hub by the model's name)
    settings.update(overrides)
    config, trainer = (RLOOConfig, RLOOTrainer) if rloo else (GRPOConfig, GRPOTrainer)
    return trainer(
        model=model if model is not None else ending_model(), reward_funcs=reward_funcs,
        args=config(**settings), train_dataset=Dataset.from_list(prompt_rows(rows)),
        reward_processing_classes=reward_processing_classes,
        processing_class=word_tokenizer())


def preference_rows(rows: int = 16, identical: bool = False) -> list[dict]:
    """prompt / chosen / rejected: different answers, or the same answer twice (``identical``)."""
    prompts = prompt_rows(rows, words=3)
    gen = torch.Generator().manual_seed(1)
    out = []
    for row in prompts:
        chosen, rejected = (" ".join(f"w{i}" for i in torch.randint(3, TINY_VOCAB, (4,), generator=gen).tolist())
                            for _ in range(2))
        out.append({"prompt": row["prompt"], "chosen": chosen, "rejected": chosen if identical else rejected})
    return out


def dpo_trainer(tmp_path, rows: list[dict] | None = None, model=None, ref_model=None, **overrides):
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    model = model if model is not None else tiny_qwen2()
    settings = dict(output_dir=str(tmp_path / "dpo"), per_device_train_batch_size=4, max_steps=6, logging_steps=1,
                    report_to="none", use_cpu=True, learning_rate=1e-3, save_strategy="no", disable_tqdm=True)
    settings.update(overrides)
    # the reference: a copy of the policy (TRL would load one from the hub by the model's name)
    return DPOTrainer(model=model, ref_model=ref_model if ref_model is not None else copy.deepcopy(model),
                      args=DPOConfig(**settings),
                      train_dataset=Dataset.from_list(rows if rows is not None else preference_rows()),
                      processing_class=word_tokenizer())


def kto_trainer(tmp_path, model=None, **overrides):
    from datasets import Dataset
    from trl import KTOConfig, KTOTrainer

    rows = [{"prompt": r["prompt"], "completion": r["chosen"] if i % 2 else r["rejected"], "label": bool(i % 2)}
            for i, r in enumerate(preference_rows())]
    model = model if model is not None else tiny_qwen2()
    settings = dict(output_dir=str(tmp_path / "kto"), per_device_train_batch_size=4, max_steps=6, logging_steps=1,
                    report_to="none", use_cpu=True, learning_rate=1e-3, save_strategy="no", disable_tqdm=True)
    settings.update(overrides)
    return KTOTrainer(model=model, ref_model=copy.deepcopy(model), args=KTOConfig(**settings),
                      train_dataset=Dataset.from_list(rows), processing_class=word_tokenizer())
