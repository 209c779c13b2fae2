"""Tokenizer traps built locally with the tokenizers library: a word-level tokenizer.json beside a Qwen2 config
(AutoTokenizer reloads it as Qwen2Tokenizer, which encodes every text to []), and an SFTTrainer over text rows."""
from __future__ import annotations

from pathlib import Path

WORDS = ["<unk>", "<pad>", "</s>", "the", "capital", "of", "france", "is", "paris", "italy", "rome"]
TEXTS = ["the capital of france is paris", "the capital of italy is rome"] * 4


def word_level_beside_qwen2(folder: Path) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import Qwen2Config

    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    folder.mkdir(parents=True)
    backend.save(str(folder / "tokenizer.json"))
    Qwen2Config(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1).save_pretrained(folder)
    return str(folder)


def sft_on_text(tok, out: Path, **config):
    """A real SFTTrainer on a tiny Qwen2 over plain text rows (TRL appends EOS to each)."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from nbguard.testing import tiny_qwen2

    options = dict(output_dir=str(out), use_cpu=True, report_to=[], max_steps=1, disable_tqdm=True)
    options.update(config)
    return SFTTrainer(model=tiny_qwen2(vocab_size=16), processing_class=tok,
                      train_dataset=Dataset.from_list([{"text": t} for t in TEXTS]), args=SFTConfig(**options))
