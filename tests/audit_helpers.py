"""Builders shared by the audit and fix tests: the seed PEFT case, training arguments, trainers."""
from __future__ import annotations

import torch

from nbguard.testing import TINY_VOCAB, TinyDataset, tiny_gemma3, tiny_llama

NEW_TOKENS = 8


def add_zero_tokens(model, n: int = NEW_TOKENS):
    """Grow the vocabulary by ``n`` tokens and zero their rows, as a hand-rolled resize often does."""
    model.resize_token_embeddings(TINY_VOCAB + n, mean_resizing=False)
    with torch.no_grad():
        model.get_input_embeddings().weight[TINY_VOCAB:] = 0
        out = model.get_output_embeddings()
        if out is not None and out.weight is not model.get_input_embeddings().weight:
            out.weight[TINY_VOCAB:] = 0
    return model


def seed_peft_model(family: str = "gemma3", dtype=torch.bfloat16, zero_tokens: bool = True, **lora):
    """The seed case: bf16 model, zero-initialised new tokens, LoRA on q/v and the embeddings, adapters kept bf16."""
    from peft import LoraConfig, get_peft_model

    model = (tiny_gemma3 if family == "gemma3" else tiny_llama)(dtype=dtype)
    if zero_tokens:
        add_zero_tokens(model)
    options = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "embed_tokens", "lm_head"])
    options.update(lora)
    return get_peft_model(model, LoraConfig(**options), autocast_adapter_dtype=False)


def tiny_gemma3_multimodal(dtype=torch.float32):
    """Gemma3ForConditionalGeneration (what Gemma 3 4B+ load as): the language model's settings live in text_config."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, sliding_window=16)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=299,
                          boi_token_index=297, eoi_token_index=298)
    torch.manual_seed(0)
    return Gemma3ForConditionalGeneration(config).to(dtype)


def healthy_peft_model():
    """fp32 model and fp32 LoRA adapters on q/v: nothing to complain about."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(tiny_llama(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))


def make_args(tmp_path, **overrides):
    """TrainingArguments for CPU runs: no saving, no reporting, a few steps."""
    from transformers import TrainingArguments

    options = dict(
        output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[], save_strategy="no",
        per_device_train_batch_size=4, per_device_eval_batch_size=4, max_steps=2, logging_steps=1,
        learning_rate=1e-4, disable_tqdm=True,
    )
    options.update(overrides)
    return TrainingArguments(**options)


def make_trainer(model, args, rows: int = 8, eval_rows: int = 4):
    from transformers import Trainer

    vocab = model.get_input_embeddings().weight.shape[0] if hasattr(model, "get_input_embeddings") else TINY_VOCAB
    return Trainer(model=model, args=args, train_dataset=TinyDataset(rows, 16, vocab_size=min(vocab, TINY_VOCAB)),
                   eval_dataset=TinyDataset(eval_rows, 16, vocab_size=min(vocab, TINY_VOCAB), seed=1))


def param_dtypes(model) -> dict[str, torch.dtype]:
    return {n: p.dtype for n, p in model.named_parameters()}


def state_copy(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}
