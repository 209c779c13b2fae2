"""Tiny real models and batches for tests, notebooks and benchmarks (built from configs; no downloads).

The architectures are the real transformers classes (Llama, Gemma 3, Qwen2) at hidden sizes of
32-128, so every failure nbguard is tested against goes through the real modelling code.
"""
from __future__ import annotations

from typing import Any

import torch

TINY_VOCAB = 128


def _tiny_common(overrides: dict[str, Any]) -> dict[str, Any]:
    base = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=0,
    )
    base.update(overrides)
    return base


def tiny_llama(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any):
    """A LlamaForCausalLM with about 50k parameters."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**_tiny_common(overrides))).to(dtype)  # type: ignore[arg-type]  # nn.Module.to(dtype)


def tiny_qwen2(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(**_tiny_common(overrides))).to(dtype)  # type: ignore[arg-type]  # nn.Module.to(dtype)


def tiny_gemma3(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any):
    """A text-only Gemma3ForCausalLM (the class Gemma 3 1B uses), sliding window included."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    params = _tiny_common({"head_dim": 16, "sliding_window": 16, **overrides})
    torch.manual_seed(seed)
    return Gemma3ForCausalLM(Gemma3TextConfig(**params)).to(dtype)  # type: ignore[arg-type]  # nn.Module.to(dtype)


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


def tiny_batch(
    batch_size: int = 2,
    seq_len: int = 16,
    vocab_size: int = TINY_VOCAB,
    *,
    seed: int = 0,
    pad_rows: int = 0,
    pad_token_id: int = 0,
) -> dict[str, torch.Tensor]:
    """input_ids / attention_mask / labels; the last ``pad_rows`` rows are padding only.

    A padding-only row has attention_mask all 0 and labels all -100, which is what an unpacked
    fp16 batch with short examples can contain.
    """
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, vocab_size, (batch_size, seq_len), generator=gen)
    attention_mask = torch.ones_like(input_ids)
    labels = input_ids.clone()
    if pad_rows:
        input_ids[-pad_rows:] = pad_token_id
        attention_mask[-pad_rows:] = 0
        labels[-pad_rows:] = -100
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


class TinyDataset(torch.utils.data.Dataset):
    """A map-style dataset of fixed-length random token rows, for real Trainer runs."""

    def __init__(self, rows: int = 32, seq_len: int = 16, vocab_size: int = TINY_VOCAB, seed: int = 0):
        batch = tiny_batch(rows, seq_len, vocab_size, seed=seed)
        self.rows = [{k: v[i] for k, v in batch.items()} for i in range(rows)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.rows[index]


def llama_8b_config():
    """The shape of Llama 3 8B (32 layers, hidden 4096, GQA 8 KV heads), for meta-device audits."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rope_theta=500000.0,
    )


def meta_llama_8b():
    """A Llama-3-8B-shaped LlamaForCausalLM on the meta device (no memory for weights)."""
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        return LlamaForCausalLM(llama_8b_config())


def tiny_4bit(family: str = "llama", compute_dtype: torch.dtype = torch.float16, dtype: torch.dtype | None = None,
              quant_type: str = "nf4", seed: int = 0, directory: str | None = None, **overrides: Any):
    """A tiny model really quantised by bitsandbytes: saved with ``save_pretrained`` and reloaded
    with ``BitsAndBytesConfig(load_in_4bit=True)`` on the CPU, so its linear layers are real
    ``bitsandbytes.nn.Linear4bit`` (needs bitsandbytes >= 0.48, whose CPU backend quantises).

    ``dtype``: what the non-quantised weights (embeddings, norms, lm_head) load as (None: float32).
    ``directory``: keep the saved checkpoint there (default: a temporary folder removed after loading).
    """
    import tempfile

    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    builders = {"llama": tiny_llama, "qwen2": tiny_qwen2, "gemma3": tiny_gemma3}
    if family not in builders:
        raise ValueError(f"family must be one of {sorted(builders)}; got {family!r}")
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type,
                                bnb_4bit_compute_dtype=compute_dtype)
    kwargs: dict[str, Any] = {"quantization_config": config, "device_map": "cpu"}
    if dtype is not None:
        kwargs["dtype"] = dtype
    with tempfile.TemporaryDirectory(prefix="nbguard-4bit-") as scratch:  # removed once loaded
        path = directory or scratch
        builders[family](seed=seed, **overrides).save_pretrained(path)
        return AutoModelForCausalLM.from_pretrained(path, **kwargs)


def plant_fp16_overflow_token(model, token: int, layer: int = 0) -> None:
    """Make ``token`` overflow fp16 in ``model.model.layers[layer].self_attn.q_proj`` while ordinary
    tokens stay under it (a batch-dependent overflow, e.g. on one rank of a DDP run).

    The token's embedding is set to q_proj's first weight row, so after the RMSNorm its first query
    feature is over twice an ordinary token's largest; q_proj is then scaled so the token gives 1.5x
    the fp16 limit while ordinary tokens stay under 0.8x (checked on a reference batch).
    """
    block = model.model.layers[layer]
    q_proj = block.self_attn.q_proj
    seen: list[float] = []
    handle = q_proj.register_forward_hook(lambda m, a, out: seen.append(out.detach().abs().max().item()))
    try:
        with torch.no_grad():
            model.model.embed_tokens.weight[token] = q_proj.weight[0]
            model(input_ids=torch.full((1, 4), token))
            hot = seen.pop()
            ids = tiny_batch(2, 12, model.config.vocab_size, seed=99)["input_ids"]
            model(input_ids=torch.where(ids == token, torch.full_like(ids, token + 1), ids))
            plain = seen.pop()
            factor = 1.5 * 65504 / hot
            if plain * factor >= 0.8 * 65504:
                raise RuntimeError(f"token {token} is not separated from ordinary tokens in {type(model).__name__}")
            q_proj.weight.mul_(factor)
    finally:
        handle.remove()
