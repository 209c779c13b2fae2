"""chat-template-serving-mismatch on real TRL SFTTrainers: the served generation prompt against the ids each
assistant turn was trained after, naming the first differing token."""
from __future__ import annotations

import pytest
from chat_helpers import WITH_GENERATION, chat_tokenizer, conversation

import nbguard
from nbguard.testing import tiny_llama

pytestmark = pytest.mark.filterwarnings("ignore")
# Qwen3-style: the generation prompt opens an empty think block that no trained assistant turn has.
THINK_PROMPT = WITH_GENERATION.replace("{% if add_generation_prompt %}<|assistant|> {% endif %}",
                                       "{% if add_generation_prompt %}<|assistant|> <think> </think> {% endif %}")


def sft_trainer(tmp_path, tok):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=1, per_device_train_batch_size=2,
                     save_strategy="no", disable_tqdm=True, max_length=64)
    rows = [{"messages": conversation(seed=i)} for i in range(4)]
    return SFTTrainer(model=tiny_llama(), args=args, processing_class=tok, train_dataset=Dataset.from_list(rows))


def test_a_generation_prompt_that_differs_names_the_first_differing_token(tmp_path):
    tok = chat_tokenizer(THINK_PROMPT)
    trainer = sft_trainer(tmp_path, tok)
    f = nbguard.audit(trainer=trainer).finding("chat-template-serving-mismatch")
    assert f is not None
    first = f.evidence["mismatches"][0]
    assert first["served"] == "<think>" and first["before"][-1] == "<|assistant|>"
    # training had the reply's first word there: the conversation's first assistant content
    assert first["trained"] == conversation(seed=first["row"])[first["turn"]]["content"].split()[0]
    assert "'<think>'" in f.title and f.evidence["turns_mismatched"] == 8  # 2 turns in each of 4 rows


def test_a_generation_prompt_that_matches_is_quiet(tmp_path):
    trainer = sft_trainer(tmp_path, chat_tokenizer(WITH_GENERATION))
    assert {"messages", "input_ids"} <= set(trainer.train_dataset.column_names)  # the rows TRL keeps
    assert nbguard.audit(trainer=trainer).finding("chat-template-serving-mismatch") is None
