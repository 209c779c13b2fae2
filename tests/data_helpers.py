"""Real tokenizers (built from a vocabulary, no downloads), ragged examples and Trainers for the data rules."""
from __future__ import annotations

import torch

from nbguard.testing import TINY_VOCAB

UNK, BOS, EOS = 0, 1, 2  # ids of <unk>, <s>, </s> in word_tokenizer's vocabulary


def word_tokenizer(pad: str | None = "eos", padding_side: str = "right", unk: bool = True):
    """A real PreTrainedTokenizerFast over words w3..w127; ``pad`` is "eos", "unk" or None (no pad token)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": UNK, "<s>": BOS, "</s>": EOS, **{f"w{i}": i for i in range(3, TINY_VOCAB)}}
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = WhitespaceSplit()
    specials = {"bos_token": "<s>", "eos_token": "</s>"}
    if unk:
        specials["unk_token"] = "<unk>"
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, padding_side=padding_side, **specials)
    if pad == "eos":
        tok.pad_token = tok.eos_token
    elif pad == "unk":
        tok.pad_token = tok.unk_token
    return tok


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
