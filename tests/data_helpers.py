"""Real tokenizers (built from a vocabulary, no downloads), ragged examples and Trainers for the data rules."""
from __future__ import annotations

import torch

from nbguard.testing import BOS, EOS, TINY_VOCAB, UNK, word_tokenizer  # noqa: F401  (the tests' tokenizer lives with the tiny models)


def ragged_examples(rows: int = 16, min_len: int = 4, max_len: int = 12, seed: int = 0, eos: bool = True):
    """Tokenised examples of varying length (words w3..w127), each ending with EOS like a chat turn does."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(rows):
        n = int(torch.randint(min_len, max_len + 1, (1,), generator=gen))
        ids = torch.randint(3, TINY_VOCAB, (n,), generator=gen).tolist() + ([EOS] if eos else [])
        out.append({"input_ids": ids})
    return out


class ListDataset(torch.utils.data.Dataset):
    def __init__(self, rows: list[dict]):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        return self.rows[index]


def lm_trainer(model, args, rows: list[dict], collator=None, tokenizer=None, trainer_class=None):
    """A real Trainer over ``rows`` with the collator a causal-LM notebook uses (padding by the tokenizer)."""
    from transformers import DataCollatorForLanguageModeling, Trainer

    if collator is None:
        collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    return (trainer_class or Trainer)(model=model, args=args, train_dataset=ListDataset(rows),
                                      data_collator=collator, processing_class=tokenizer)
