"""The reproductions the verification tests run fixes on (tiny real models, real Trainer runs)."""
from __future__ import annotations

import tempfile

import torch
from watch_helpers import batches, scale_output_to, train

import nbguard
from nbguard.testing import TinyDataset, tiny_gemma3, tiny_llama

NEW_TOKENS, VOCAB = 4, 128


def peft_zero_embeddings(layers: int = 10):
    """notebooks/02: bf16 Gemma 3, new tokens with zero rows, LoRA (bf16) on embeddings and attention.

    Depth matters: a zero hidden state multiplies the gradient by rsqrt(eps) at every RMSNorm.
    """
    from peft import LoraConfig, get_peft_model

    model = tiny_gemma3(seed=0, dtype=torch.bfloat16, num_hidden_layers=layers)
    model.resize_token_embeddings(VOCAB + NEW_TOKENS, mean_resizing=False)
    with torch.no_grad():
        model.get_input_embeddings().weight[VOCAB:] = 0  # lm_head is tied to it
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "embed_tokens", "lm_head"])
    return get_peft_model(model, config, autocast_adapter_dtype=False)


def chat_rows(rows: int = 8, seq_len: int = 16) -> TinyDataset:
    """Rows that start with a new special token (a ChatML template without BOS)."""
    data = TinyDataset(rows=rows, seq_len=seq_len)
    for i, row in enumerate(data.rows):
        row["input_ids"][0] = row["labels"][0] = VOCAB + i % NEW_TOKENS
    return data


def chat_batch(rows: int = 4, seq_len: int = 16) -> dict[str, torch.Tensor]:
    data = chat_rows(rows, seq_len)
    return {k: torch.stack([r[k] for r in data.rows]) for k in data.rows[0]}


def peft_trainer(model, steps: int = 2):
    from transformers import PrinterCallback, Trainer, TrainingArguments

    args = TrainingArguments(output_dir=tempfile.mkdtemp(), use_cpu=True, max_steps=steps,
                             per_device_train_batch_size=4, learning_rate=2e-4, logging_steps=1,
                             save_strategy="no", report_to=[], disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=chat_rows())
    trainer.remove_callback(PrinterCallback)
    return trainer


def verdicts(verification) -> dict[str, str]:
    return {v.fix: v.verdict for v in verification.verdicts}


def everything(model, optimizer=None, identity: bool = True) -> dict:
    """Every piece of user state verification must leave bit-identical.

    ``identity``: also the tensors' addresses and in-place version counters (False to compare two runs).
    """
    def who(t):
        return (t.data_ptr(), t._version, id(t)) if identity and t is not None else None

    state = {
        "params": {n: (p.dtype, p.detach().clone(), who(p)) for n, p in model.named_parameters()},
        "grads": {n: (who(p.grad), None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()},
        "buffers": {n: b.detach().clone() for n, b in model.named_buffers()},
        "rng": torch.get_rng_state(),
        "training": {n: m.training for n, m in model.named_modules()},
        "attributes": {n: sorted(vars(m)) for n, m in model.named_modules()},
        "checkpointing": {n: getattr(m, "gradient_checkpointing", None) for n, m in model.named_modules()},
        "hooks": {n: (len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks))
                  for n, m in model.named_modules()},
        "use_cache": getattr(getattr(model, "config", None), "use_cache", None),
    }
    if optimizer is not None:
        state["optimizer"] = {k: {kk: vv.clone() if isinstance(vv, torch.Tensor) else vv for kk, vv in v.items()}
                              for k, v in optimizer.state_dict()["state"].items()}
        state["param_groups"] = optimizer.state_dict()["param_groups"]
    return state


def assert_same(before: dict, after: dict) -> None:
    assert before.keys() == after.keys()
    for key in before:
        a, b = before[key], after[key]
        if key == "rng":
            assert torch.equal(a, b), "RNG state changed"
        elif key in ("params", "grads", "buffers", "optimizer"):
            assert a.keys() == b.keys(), key
            for name in a:
                assert _equal(a[name], b[name]), f"{key} {name} changed"
        else:
            assert a == b, f"{key} changed"


def _equal(x, y) -> bool:
    if isinstance(x, torch.Tensor):
        return isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(torch.nan_to_num(x), torch.nan_to_num(y)) \
            and torch.equal(torch.isnan(x), torch.isnan(y))
    if isinstance(x, (tuple, list)):
        return len(x) == len(y) and all(_equal(a, b) for a, b in zip(x, y))
    if isinstance(x, dict):
        return x.keys() == y.keys() and all(_equal(x[k], y[k]) for k in x)
    return x == y


def fp16_overflow_run(**watch_options):
    """up_proj's output is 2e5: it overflows fp16 (65504), fits bf16 and fp32."""
    model = tiny_llama()
    data = batches(2)
    scale_output_to(model, model.model.layers[1].mlp.up_proj, data[0], 2e5)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with nbguard.watch(model, optimizer=opt, policy="skip", **watch_options) as watch:
        train(model, opt, data[:1], autocast=torch.float16)
    return model, opt, watch
