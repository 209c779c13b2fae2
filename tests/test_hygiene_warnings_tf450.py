"""The two warnings today's releases no longer emit, raised for real by the releases that did.

transformers 4.50 + trl 0.18 (the tf450 lane): trl's DataCollatorForCompletionOnlyLM on a row
without its response template, and Gemma2ForCausalLM training with SDPA attention. A tokenizer
is built from a word list (no download).
"""
from __future__ import annotations

import pytest
from notebook_helpers import run
from test_hygiene_warnings import _signatures, seen_by_user  # noqa: F401  (the user's showwarning + nbguard)

pytestmark = pytest.mark.tf450

COLLATOR = """
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from trl import DataCollatorForCompletionOnlyLM
words = ["[PAD]", "[UNK]", "###", "Question", ":", "Response", "hi", "there", "4"]
backend = Tokenizer(models.WordLevel({{w: i for i, w in enumerate(words)}}, unk_token="[UNK]"))
backend.pre_tokenizer = pre_tokenizers.Whitespace()
tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]")
collator = DataCollatorForCompletionOnlyLM(response_template="### Response:", tokenizer=tokenizer)
labels = collator([{{"input_ids": tokenizer({text!r})["input_ids"]}}])["labels"]
"""
GEMMA2 = """
import torch
from transformers import Gemma2Config, Gemma2ForCausalLM
config = Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, attn_implementation={impl!r})
gemma = Gemma2ForCausalLM(config).train()
ids = torch.randint(0, 64, (2, 8))
gemma(input_ids=ids, labels=ids).loss
"""


def test_real_trl_collator_without_its_template_is_explained(seen_by_user):
    ip, shown = seen_by_user
    cell = run(ip, COLLATOR.format(text="### Question : hi there"))
    assert cell.error is None, cell.stderr
    assert any("Could not find response key `### Response:`" in s for s in shown)  # still shown to the user
    assert (ip.user_ns["labels"] == -100).all()  # the real mechanism: the row trains on nothing
    assert _signatures(cell) == ["response-key-not-found"]


def test_real_trl_collator_that_finds_its_template_gives_no_card(seen_by_user):
    ip, _shown = seen_by_user
    cell = run(ip, COLLATOR.format(text="### Question : hi ### Response : 4"))
    assert cell.error is None and (ip.user_ns["labels"] != -100).any()
    assert _signatures(cell) == []


def test_real_gemma2_sdpa_training_recommendation_is_explained(seen_by_user):
    ip, _shown = seen_by_user
    cell = run(ip, GEMMA2.format(impl="sdpa"))
    assert cell.error is None, cell.stderr
    assert _signatures(cell) == ["gemma2-eager-attention"]


def test_real_gemma2_eager_training_gives_no_card(seen_by_user):
    ip, _shown = seen_by_user
    cell = run(ip, GEMMA2.format(impl="eager"))
    assert cell.error is None and _signatures(cell) == []
