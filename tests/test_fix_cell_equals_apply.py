"""For every registered fix: running its cell leaves the same state as calling ``apply`` (issue #42, 4b).

Each case builds a world of real objects twice from the same seed (tiny transformers models, real
Trainers and TrainingArguments, PEFT LoRA, TRL configs, real tokenizers, torch optimizers). One copy goes
through ``nbguard.fixes.apply``; on the other runs the cell that call recorded (``FixResult.code``, the text a
user keeps), exec'd with the world's objects bound to the names the cell uses. Then everything the fixes
can touch is read off both copies and compared: parameters (dtype, values, requires_grad, which weights
are shared), module modes, hooks and fp32 forwards, configs, the arguments' fields, optimizer groups and
state, schedulers, tokenizers, the trainer's data, collator output and reward functions, the files an export
fix writes, and the process-wide switches (accelerate's environment variable, torch's cuDNN attention).

A fix registered without a case here fails ``test_every_fix_has_a_case``: add its case to CASES.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from audit_helpers import (
    add_zero_tokens,
    healthy_peft_model,
    make_args,
    make_trainer,
    seed_peft_model,
    tiny_gemma3_multimodal,
)
from chat_helpers import chat_tokenizer
from data_helpers import BOS, EOS, ListDataset, lm_trainer, ragged_examples, word_tokenizer
from rl_helpers import grpo_trainer, log_match_reward

import nbguard.fixes as fixes
from nbguard.testing import TINY_VOCAB, TinyDataset, tiny_4bit, tiny_batch, tiny_gemma3, tiny_llama


@dataclasses.dataclass
class Case:
    """``build(tmp)`` returns a fresh world (apply's keywords -> objects, plus "features" to run collators on);
    ``given``: the keys of the world passed to apply (and so named in its cell); ``options``: the fix's
    options, or a function of the tmp folder returning them (export fixes write under it)."""

    build: Callable[[Path], dict[str, Any]]
    given: tuple[str, ...]
    options: dict[str, Any] | Callable[[Path], dict[str, Any]] = dataclasses.field(default_factory=dict)
    skip: str | None = None  # why this case cannot run on a CPU machine (kept rare)
    writes: str | None = None  # the option naming the folder the fix writes (its files are compared)
    quant: bool = False  # needs torchao: runs in the quant lane (pytest -m quant, .venv-quant)


# ---- builders ----------------------------------------------------------------------------------
def _trainer(tmp: Path, model=None, **overrides: Any) -> dict[str, Any]:
    return {"trainer": make_trainer(model if model is not None else tiny_llama(), make_args(tmp, **overrides))}


def _fixed_rows(rows: list[dict[str, list[int]]]) -> list[dict[str, torch.Tensor]]:
    return [{k: torch.tensor(v) for k, v in row.items()} for row in rows]


def _collator_trainer(tmp: Path, rows: list[dict[str, list[int]]], model=None) -> dict[str, Any]:
    """A Trainer over fixed-length rows with transformers' default collator (it stacks every column)."""
    from transformers import Trainer, default_data_collator

    data = _fixed_rows(rows)
    trainer = Trainer(model=model if model is not None else tiny_llama(), args=make_args(tmp),
                      train_dataset=ListDataset(data), data_collator=default_data_collator)
    return {"trainer": trainer, "features": data[:2]}


def _lm_trainer(tmp: Path, tok, rows=None, dataset=None) -> dict[str, Any]:
    rows = rows if rows is not None else ragged_examples(8)
    trainer = lm_trainer(tiny_llama(), make_args(tmp), rows, tokenizer=tok)
    if dataset is not None:
        trainer.train_dataset = dataset
    return {"trainer": trainer, "features": [dict(r) for r in rows[:2]]}


def _loop(dtype=torch.float32, eps: float = 1e-8) -> dict[str, Any]:
    model = tiny_llama(dtype=dtype)
    return {"model": model, "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-3, eps=eps)}


def _built_optimizer(tmp: Path) -> dict[str, Any]:
    trainer = make_trainer(tiny_llama(), make_args(tmp))
    trainer.create_optimizer_and_scheduler(num_training_steps=4)
    return {"trainer": trainer}


MOE = dict(vocab_size=TINY_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, num_experts_per_tok=2)


def _tiny_moe(family: str):
    import transformers

    torch.manual_seed(0)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(num_experts=4, moe_intermediate_size=64,
                                                                            **MOE))
    return transformers.PhimoeForCausalLM(transformers.PhimoeConfig(num_local_experts=4, **MOE))


def _tiny_mixtral(**lora: Any):
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    model = MixtralForCausalLM(MixtralConfig(num_local_experts=4, **MOE))
    if not lora:
        return model
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, **lora))


def _trainable_tokens():
    """PEFT trainable_token_indices over zero rows: each chosen token trains its own copy of its row."""
    from peft import LoraConfig, get_peft_model

    model = add_zero_tokens(tiny_llama())
    return get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"],
                                            trainable_token_indices=[TINY_VOCAB, TINY_VOCAB + 1]))


def _four_bit(tmp: Path) -> dict[str, Any]:
    pytest.importorskip("bitsandbytes", reason="tiny_4bit quantises with bitsandbytes' CPU backend")
    folder = tmp / "4bit"  # one folder for both copies: the config names it (_name_or_path)
    return {"model": tiny_4bit(compute_dtype=torch.float16, dtype=torch.float16, directory=str(folder))}


def _float8_llama():
    """Real torchao per-row float8 layers without an activation lower bound (pytorch/ao#3356), as
    tests/test_quantized_dry_pass.py builds them: only quantize_'s CUDA capability gate is lifted, the
    Float8Tensor math runs on the CPU."""
    pytest.importorskip("torchao", reason="torchao is installed in the quant lane only (.venv-quant, make test-quant)")
    import torchao.quantization.quant_api as quant_api
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

    model = tiny_llama(dtype=torch.bfloat16)
    gate = quant_api._check_hardware_support
    quant_api._check_hardware_support = lambda granularities: None
    try:
        quantize_(model, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))
    finally:
        quant_api._check_hardware_support = gate
    return model


def _bloom_attention_in_eval():
    """Bloom's attention holds its dropout as an nn.Dropout named attention_dropout (not a float)."""
    from transformers import BloomConfig, BloomForCausalLM

    torch.manual_seed(0)
    model = BloomForCausalLM(BloomConfig(vocab_size=TINY_VOCAB, hidden_size=32, n_layer=2, n_head=4,
                                         attention_dropout=0.1, hidden_dropout=0.1)).train()
    model.transformer.h[0].self_attention.eval()
    return model


def _partly_eval(model):
    model.train()
    model.model.layers[0].self_attn.eval()  # a wrapper's train() did not reach this attention (dropout 0.1)
    return model


def _checkpointing(tmp: Path, **args: Any) -> dict[str, Any]:
    model = tiny_llama()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    return {"trainer": make_trainer(model, make_args(tmp, **args))}  # by default args.gradient_checkpointing is False


def _rows_file(tmp: Path) -> dict[str, Any]:
    """drop-rows reading the dataset indices from the JSON file a watch saved."""
    (tmp / "rows.json").write_text(json.dumps({"dataset_indices": [0, 6]}))
    return _trainer(tmp)


def _eval_and_eos_pad(tmp: Path) -> dict[str, Any]:
    return _lm_trainer(tmp, word_tokenizer(pad="eos", unk=False))


def _doubled_bos(tmp: Path) -> dict[str, Any]:
    from datasets import Dataset

    rows = [{"input_ids": ([BOS] if i % 2 else []) + [BOS, 5 + i, 6 + i, EOS],
             "attention_mask": [1] * (5 if i % 2 else 4)} for i in range(6)]
    tok = word_tokenizer(pad="unk")
    world = _lm_trainer(tmp, tok, rows, dataset=Dataset.from_list(rows))
    return world


def _unsupervised_rows(tmp: Path) -> dict[str, Any]:
    data = TinyDataset(8, 16)
    for i in (1, 4):
        data.rows[i]["labels"] = torch.full((16,), -100)
    trainer = make_trainer(tiny_llama(), make_args(tmp))
    trainer.train_dataset = data
    return {"trainer": trainer}


def _unsupervised_dataset(tmp: Path) -> dict[str, Any]:
    """A datasets.Dataset of ragged rows: one all -100, one whose only label is its first (shifted away)."""
    from datasets import Dataset

    rows = [{"input_ids": [5, 6, 7], "labels": [5, 6, 7]}, {"input_ids": [8, 9], "labels": [-100, -100]},
            {"input_ids": [10], "labels": [10]}, {"input_ids": [11, 12], "labels": [11, -100]},
            {"input_ids": [13, 14], "labels": [-100, 14]}]
    trainer = make_trainer(tiny_llama(), make_args(tmp))
    trainer.train_dataset = Dataset.from_list(rows)
    return {"trainer": trainer, "features": []}


def _truncated(tmp: Path) -> dict[str, Any]:
    tok = word_tokenizer(pad="unk")
    lengths = {2: 20, 9: 14, 20: 30}
    texts = [" ".join(f"w{3 + (i * 7 + j * 3) % 120}" for j in range(lengths.get(i, 3 + (i * 5 + 1) % 7)))
             for i in range(24)]
    rows = [{"input_ids": tok(t + " </s>", truncation=True, max_length=12)["input_ids"]} for t in texts]
    return _lm_trainer(tmp, tok, rows)


def _truncated_list(tmp: Path) -> dict[str, Any]:
    world = _truncated(tmp)
    world["trainer"].train_dataset = list(world["trainer"].train_dataset.rows)  # a plain list of rows
    return world


def _packed(tmp: Path) -> dict[str, Any]:
    ids = list(range(10, 18))
    return _collator_trainer(tmp, [{"input_ids": ids, "attention_mask": [1] * 8, "labels": ids,
                                    "position_ids": [0, 1, 2, 3, 0, 1, 2, 3]}] * 4)


def _shifted_labels(tmp: Path) -> dict[str, Any]:
    ids = list(range(10, 18))
    return _collator_trainer(tmp, [{"input_ids": ids, "attention_mask": [1] * 8, "labels": ids[1:] + [-100]}] * 4)


def _image_labels(tmp: Path) -> dict[str, Any]:
    ids = [297, 299, 299, 298, 10, 11, 12, 2]
    model = tiny_gemma3_multimodal()
    return _collator_trainer(tmp, [{"input_ids": ids, "attention_mask": [1] * 8,
                                    "labels": [-1, 299, 299, 298, 10, 11, 12, 2]}] * 4, model=model)


def _image_index_labels(tmp: Path) -> dict[str, Any]:
    """An older multimodal config: the placeholder id as image_token_index only."""
    model = tiny_llama()
    model.config.image_token_index = 100
    ids = [100, 100, 10, 11, 12, 13, 14, 2]
    return _collator_trainer(tmp, [{"input_ids": ids, "attention_mask": [1] * 8,
                                    "labels": [100, 100, -5, 11, 12, 13, 14, 2]}] * 4, model=model)


def _rl_args(kind: str, tmp: Path, **values: Any) -> dict[str, Any]:
    import trl

    config = {"grpo": trl.GRPOConfig, "dpo": trl.DPOConfig}[kind]
    return {"args": config(output_dir=str(tmp / kind), use_cpu=True, report_to="none", **values)}


def _peft_and_base(tmp: Path) -> dict[str, Any]:
    """A LoRA model on a base saved under tmp/base (merge-in-fp32 reloads it from there), its adapter trained."""
    from peft import LoraConfig, get_peft_model

    base = tmp / "base"
    if not base.exists():
        tiny_llama().save_pretrained(base)
    model = get_peft_model(tiny_llama(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():  # a trained adapter: lora_B no longer zero
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.linspace(-0.1, 0.1, p.numel()).reshape(p.shape))
    return {"model": model}


def _resized_tokenizer() -> dict[str, Any]:
    tok = word_tokenizer()
    tok.add_tokens(["x1", "x2", "x3"])
    return {"model": tiny_llama(), "tokenizer": tok}


def _fp16_trainer(tmp: Path) -> dict[str, Any]:
    # fp16 weights and args.fp16, set once the Trainer was built (its accelerator runs without mixed precision)
    trainer = make_trainer(tiny_llama(dtype=torch.float16), make_args(tmp))
    trainer.args.fp16 = True
    return {"trainer": trainer}


def _bf16_trained(tmp: Path) -> dict[str, Any]:
    trainer = make_trainer(healthy_peft_model(), make_args(tmp, bf16=True))
    trainer.train()  # prepare() wrapped the forward in bf16 autocast; the optimizer holds moments
    return {"trainer": trainer}


def _fp16_loop_stepped() -> dict[str, Any]:
    world = _loop(torch.float16, eps=1e-4)
    model, opt = world["model"], world["optimizer"]
    model(**tiny_batch(2, 8)).loss.float().backward()
    opt.step()
    return world


MOE_LLAMA_NAMES = ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]

CASES: dict[str, list[Case]] = {
    "add-entropy-bonus": [Case(lambda t: _rl_args("grpo", t), ("args",), {"coef": 0.02})],
    "add-warmup": [Case(lambda t: {"args": make_args(t)}, ("args",))],
    "disable-cudnn-sdp": [Case(lambda t: {"model": tiny_llama()}, ("model",))],
    "disable-dropout": [Case(lambda t: {"model": tiny_llama(attention_dropout=0.1)}, ("model",)),
                        Case(lambda t: {"model": _bloom_attention_in_eval()}, ("model",))],
    "disable-use-cache": [Case(lambda t: {"model": tiny_gemma3_multimodal()}, ("model",))],
    "distinct-pad-token": [Case(_eval_and_eos_pad, ("trainer",)),
                           Case(lambda t: {"tokenizer": word_tokenizer(pad="eos"), "model": tiny_gemma3_multimodal()},
                                ("tokenizer", "model")),
                           Case(lambda t: {"tokenizer": word_tokenizer(pad="eos"), "model": tiny_llama()},
                                ("tokenizer", "model"))],
    "drop-doubled-bos": [Case(_doubled_bos, ("trainer",))],
    "drop-mask-for-packing": [Case(_packed, ("trainer",))],
    "drop-rows": [Case(_trainer, ("trainer",), {"indices": [1, 5]}),
                  Case(_rows_file, ("trainer",), lambda t: {"path": str(t / "rows.json")})],
    "drop-truncated-rows": [Case(_truncated, ("trainer",)), Case(_truncated_list, ("trainer",))],
    "drop-unsupervised-rows": [Case(_unsupervised_rows, ("trainer",)), Case(_unsupervised_dataset, ("trainer",))],
    "dropout-train-mode": [Case(lambda t: {"model": _partly_eval(tiny_llama(attention_dropout=0.1))}, ("model",)),
                           Case(lambda t: {"model": _bloom_attention_in_eval()}, ("model",))],
    "enable-grad-clipping": [Case(lambda t: _trainer(t, max_grad_norm=0.0), ("trainer",)), Case(lambda t: _loop(), ("optimizer",))],
    "enable-input-require-grads": [Case(lambda t: {"model": healthy_peft_model()}, ("model",))],
    "enable-router-aux-loss": [Case(lambda t: {"model": _tiny_mixtral()}, ("model",)),
                               Case(lambda t: {"model": _tiny_moe("qwen3_moe")}, ("model",))],
    "finite-rewards": [Case(lambda t: {"trainer": grpo_trainer(t, reward_funcs=[log_match_reward])}, ("trainer",)),
                       Case(lambda t: {"trainer": grpo_trainer(t, reward_funcs=[log_match_reward])}, ("trainer",),
                            {"floor": -1.0})],
    "float8-activation-lb": [Case(lambda t: {"model": _float8_llama()}, ("model",), quant=True)],
    "freeze-moe-router": [Case(lambda t: {"model": _tiny_mixtral()}, ("model",)),
                          Case(lambda t: {"model": _tiny_moe("qwen3_moe")}, ("model",)),
                          Case(lambda t: {"model": _tiny_moe("phimoe")}, ("model",))],
    "full-vocabulary-sampling": [Case(lambda t: _rl_args("grpo", t, top_p=0.9, top_k=50, min_p=0.05,
                                                         generation_kwargs={"top_k": 20, "repetition_penalty": 1.1}),
                                      ("args",))],
    "init-new-embeddings": [Case(lambda t: {"model": add_zero_tokens(tiny_llama())}, ("model",)),
                            Case(lambda t: {"model": _trainable_tokens()}, ("model",)),
                            Case(lambda t: {"model": add_zero_tokens(tiny_llama(tie_word_embeddings=True))}, ("model",)),
                            Case(lambda t: {"model": seed_peft_model("llama")}, ("model",))],
    "lora-target-fused-experts": [Case(lambda t: {"model": _tiny_mixtral(target_modules=MOE_LLAMA_NAMES)},
                                       ("model",))],
    "lower-beta": [Case(lambda t: _rl_args("dpo", t, beta=0.5), ("args",))],
    "lower-learning-rate": [Case(_built_optimizer, ("trainer",)), Case(lambda t: _loop(), ("optimizer",))],
    "mask-special-labels": [Case(_image_labels, ("trainer",)), Case(_image_index_labels, ("trainer",))],
    "match-sampling-settings": [Case(lambda t: _rl_args("grpo", t, top_p=0.9, repetition_penalty=1.1,
                                                        generation_kwargs={"temperature": 0.5, "top_k": 20}),
                                     ("args",))],
    "merge-in-fp32": [Case(_peft_and_base, ("model",),
                           lambda t: {"path": str(t / "merged"), "base": str(t / "base"), "dtype": "bfloat16"}, writes="path")],
    "model-train-mode": [Case(lambda t: {"model": tiny_llama(attention_dropout=0.1).eval()}, ("model",))],
    "non-reentrant-checkpointing": [Case(_checkpointing, ("trainer",)),
                                    Case(lambda t: _checkpointing(t, gradient_checkpointing=True), ("trainer",)),
                                    Case(lambda t: {"model": _checkpointing(t)["trainer"].model}, ("model",))],
    "optimizer-eps-for-dtype": [Case(lambda t: _loop(torch.float16), ("optimizer",))],
    "pad-right-for-training": [Case(lambda t: {"tokenizer": word_tokenizer(padding_side="left")}, ("tokenizer",))],
    "raise-temperature": [Case(lambda t: _rl_args("grpo", t, temperature=0.7), ("args",))],
    "resave-adapter": [Case(_peft_and_base, ("model",), lambda t: {"path": str(t / "adapter")}, writes="path")],
    "resize-token-embeddings": [Case(lambda t: _resized_tokenizer(), ("model", "tokenizer"))],
    "save-embedding-layers": [Case(_peft_and_base, ("model",), lambda t: {"path": str(t / "adapter")},
                                   writes="path")],
    "save-tokenizer": [Case(lambda t: {"tokenizer": chat_tokenizer()}, ("tokenizer",),
                            lambda t: {"path": str(t / "tokenizer")}, writes="path"),
                       Case(lambda t: _lm_trainer(t, chat_tokenizer()), ("trainer",),
                            lambda t: {"path": str(t / "tokenizer")}, writes="path"),
                       Case(lambda t: {"tokenizer": chat_tokenizer()}, ("tokenizer",),
                            lambda t: {"path": str(t / "tokenizer"), "chat_template": "{{ messages[0]['content'] }}"},
                            writes="path")],
    "scale-loss-for-accumulation": [Case(_trainer, ("trainer",))],
    "set-attn-implementation": [Case(lambda t: {"model": tiny_llama()}, ("model",), {"to": "eager"}),
                                Case(lambda t: {"model": tiny_gemma3(attn_logit_softcapping=50.0)}, ("model",))],
    "switch-precision": [Case(_fp16_trainer, ("trainer",), {"to": "bf16"}),
                         Case(_bf16_trained, ("trainer",), {"to": "fp32"}),
                         Case(lambda t: {"model": seed_peft_model("llama", dtype=torch.float16)}, ("model",),
                              {"to": "bf16"}),
                         Case(lambda t: _fp16_loop_stepped(), ("model", "optimizer"), {"to": "fp32"}),
                         Case(lambda t: {"model": tiny_llama(dtype=torch.float16)}, ("model",),
                              {"to": "fp32", "only": ["model.layers.1.mlp"]}),
                         Case(_four_bit, ("model",), {"to": "bf16"})],
    "sync-pad-token-id": [Case(lambda t: {"model": tiny_llama(), "tokenizer": word_tokenizer(pad="eos")},
                               ("model", "tokenizer")),
                          Case(lambda t: {"model": tiny_gemma3_multimodal(), "tokenizer": word_tokenizer(pad="eos")},
                               ("model", "tokenizer"))],
    "tokenizer-no-bos": [Case(lambda t: {"tokenizer": chat_tokenizer(add_bos=True)}, ("tokenizer",))],
    "unshift-labels": [Case(_shifted_labels, ("trainer",))],
    "unsloth-precision": [Case(lambda t: {}, ("model",), skip=(
        "its cell reloads the model through unsloth.FastLanguageModel, and Unsloth installs and loads only with a "
        "CUDA GPU"))],
    "untie-embeddings": [Case(lambda t: {"model": tiny_llama(tie_word_embeddings=True)}, ("model",)),
                         Case(lambda t: {"model": seed_peft_model(dtype=torch.float32, zero_tokens=False)}, ("model",)),
                         Case(lambda t: {"model": tiny_gemma3_multimodal()}, ("model",))],
    "upcast-trainable-fp32": [Case(lambda t: {"model": seed_peft_model("llama")}, ("model",)),
                              Case(lambda t: _fp16_loop_stepped(), ("model", "optimizer"))],
    "cast-inputs-to-float32": [Case(lambda t: {"model": tiny_llama()}, ("model",))],
}


# ---- what a fix can change, read off a world ---------------------------------------------------
def _plain(value: Any) -> Any:
    """A value as comparable data: tensors stay tensors, containers recurse, objects become their type name."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value
        return [_plain(v) for v in items]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.dtype):
        return str(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):  # e.g. torchao's act_quant_kwargs
        return {"class": type(value).__name__, **{f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}}
    if isinstance(value, functools.partial):
        return {"partial": getattr(value.func, "__name__", "?"), "keywords": _plain(value.keywords)}
    return f"<{type(value).__name__}>"


def _value(p: torch.Tensor) -> Any:
    """A parameter's values; a torchao float8 weight's as its quantised data and scale."""
    if hasattr(p, "qdata") and hasattr(p, "scale"):
        return [p.qdata.detach().view(torch.uint8).clone(), p.scale.detach().clone()]
    return p.detach().clone()


def _module_state(model: torch.nn.Module) -> dict[str, Any]:
    first_name: dict[int, str] = {}
    params = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        shared = first_name.setdefault(id(p), name)
        params[name] = {"dtype": str(p.dtype), "requires_grad": p.requires_grad, "shares": shared,
                        "value": _value(p), "class": type(p).__name__,
                        "act_quant_kwargs": _plain(getattr(p, "act_quant_kwargs", None))}
    modules = {}
    for name, module in model.named_modules(remove_duplicate=False):
        attrs = {k: _plain(v) for k, v in vars(module).items()
                 if not k.startswith("_") or k in ("_require_grads_hook", "_gradient_checkpointing_func")
                 or k.startswith("_nbguard")}
        attrs.pop("config", None)
        attrs.pop("peft_config", None)
        modules[name] = {"class": type(module).__name__, "training": module.training,
                         "forward_hooks": len(module._forward_hooks), "pre_hooks": len(module._forward_pre_hooks),
                         "own_forward": "forward" in vars(module), **attrs}
    state = {"params": params, "buffers": {n: b.detach().clone() for n, b in model.named_buffers()},
             "modules": modules}
    config = getattr(model, "config", None)
    if config is not None:
        state["config"] = _plain(config.to_dict())
        getter = getattr(config, "get_text_config", None)
        text = getter() if callable(getter) else config
        state["text_config"] = _plain(text.to_dict())
        state["attn"] = [getattr(c, "_attn_implementation", None) for c in (config, text)]
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        state["generation_config"] = _plain(generation.to_dict())
    peft = getattr(model, "peft_config", None)
    if isinstance(peft, dict):
        state["peft_config"] = {k: _plain(v.to_dict()) for k, v in peft.items()}
    torch.manual_seed(0)  # dropout in training mode: the same draws on both sides
    try:
        out = model(**{k: v for k, v in tiny_batch(2, 8).items() if k != "labels"})
        state["forward"] = {"logits": out.logits.detach().float().clone(), "dtype": str(out.logits.dtype),
                            "requires_grad": out.logits.requires_grad}
    except Exception as exc:  # noqa: BLE001  (a model that cannot run this batch: both sides must fail alike)
        state["forward"] = f"{type(exc).__name__}: {exc}"
    return state


def _config_state(args: Any) -> dict[str, Any]:
    fields = {f.name: _plain(getattr(args, f.name, None)) for f in dataclasses.fields(args)}
    extra = {k: _plain(v) for k, v in vars(args).items() if k not in fields and not k.startswith("_")}
    return {"fields": fields, "extra": extra, "class": type(args).__name__}


def _optimizer_state(optimizer: Any) -> dict[str, Any]:
    groups = [{k: _plain(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    moments = [{k: (str(v.dtype), v.clone()) if torch.is_tensor(v) else v for k, v in s.items()}
               for s in optimizer.state.values()]
    extra = {k: _plain(v) for k, v in vars(optimizer).items() if k.startswith("_clip")}
    hooks = list(getattr(optimizer, "_optimizer_step_pre_hooks", {}).values())
    state = {"groups": groups, "state": moments, "extra": extra, "pre_hooks": len(hooks)}
    if hooks:  # what they do to a known gradient (clipping before the step)
        params = [p for g in optimizer.param_groups for p in g["params"]]
        saved = [p.grad for p in params]
        for i, p in enumerate(params):
            p.grad = torch.full_like(p, float(i % 7 + 1))
        for hook in hooks:
            hook(optimizer, (), {})
        state["grads_after_pre_hooks"] = [p.grad.clone() for p in params]
        for p, g in zip(params, saved):
            p.grad = g
    return state


def _tokenizer_state(tok: Any) -> dict[str, Any]:
    return {"padding_side": tok.padding_side, "pad": (tok.pad_token, tok.pad_token_id), "len": len(tok),
            "add_bos_token": getattr(tok, "add_bos_token", None), "chat_template": tok.chat_template,
            "encoded": tok("w5 w6 w7")["input_ids"], "specials": _plain(tok.special_tokens_map)}


def _rows(data: Any) -> Any:
    if data is None:
        return None
    return {"class": type(data).__name__, "rows": [_plain(dict(data[i])) for i in range(len(data))]}


def _trainer_state(trainer: Any, features: list[dict] | None) -> dict[str, Any]:
    state: dict[str, Any] = {"model": _module_state(trainer.model), "args": _config_state(trainer.args),
                             "data": _rows(trainer.train_dataset)}
    for flag in ("model_accepts_loss_kwargs", "loss_is_scaled_for_ga"):
        state[flag] = getattr(trainer, flag, None)
    if trainer.optimizer is not None:  # (accelerate's wrapper holds the torch optimizer)
        state["optimizer"] = _optimizer_state(getattr(trainer.optimizer, "optimizer", trainer.optimizer))
    if getattr(trainer, "lr_scheduler", None) is not None:
        state["base_lrs"] = list(trainer.lr_scheduler.base_lrs)
    accelerator = getattr(trainer, "accelerator", None)
    state["mixed_precision"] = getattr(accelerator, "mixed_precision", None)
    tok = trainer.processing_class
    if tok is not None:
        state["tokenizer"] = _tokenizer_state(tok)
    collator = trainer.data_collator
    state["collator"] = {"class": type(collator).__name__,
                         "pad_token_id": _plain(getattr(collator, "pad_token_id", None))}
    if features is None and trainer.train_dataset is not None:
        features = [trainer.train_dataset[i] for i in range(min(2, len(trainer.train_dataset)))]
    if features:
        state["collated"] = _plain(collator([dict(f) for f in features]))
    funcs = getattr(trainer, "reward_funcs", None)
    if isinstance(funcs, list):
        completions = ["w5 w5 w9", "w3 w4", "w5"]
        state["rewards"] = [f(prompts=["w8"] * 3, completions=completions) for f in funcs
                            if not isinstance(f, torch.nn.Module)]
    return state


def _files(path: str) -> dict[str, Any]:
    from safetensors.torch import load_file

    out: dict[str, Any] = {}
    for file in sorted(Path(path).rglob("*")) if Path(path).exists() else ():
        name = str(file.relative_to(path))
        if file.suffix == ".safetensors":
            out[name] = load_file(str(file))
        elif file.suffix == ".json":
            out[name] = json.loads(file.read_text())
        elif file.is_file():
            out[name] = file.read_bytes()
    return out


def _globals() -> dict[str, Any]:
    return {"ACCELERATE_MIXED_PRECISION": os.environ.get("ACCELERATE_MIXED_PRECISION"),
            "cudnn_sdp": torch.backends.cuda.cudnn_sdp_enabled()}


def _restore(saved: dict[str, Any]) -> None:
    if saved["ACCELERATE_MIXED_PRECISION"] is None:
        os.environ.pop("ACCELERATE_MIXED_PRECISION", None)
    else:
        os.environ["ACCELERATE_MIXED_PRECISION"] = saved["ACCELERATE_MIXED_PRECISION"]
    torch.backends.cuda.enable_cudnn_sdp(saved["cudnn_sdp"])


def snapshot(world: dict[str, Any], path: str | None) -> dict[str, Any]:
    state: dict[str, Any] = {"globals": _globals()}
    for key, value in world.items():
        if key == "features":
            continue
        if key == "trainer":
            state[key] = _trainer_state(value, world.get("features"))
        elif isinstance(value, torch.nn.Module):
            state[key] = _module_state(value)
        elif isinstance(value, torch.optim.Optimizer):
            state[key] = _optimizer_state(value)
        elif dataclasses.is_dataclass(value):
            state[key] = _config_state(value)
        elif hasattr(value, "padding_side"):
            state[key] = _tokenizer_state(value)
        else:
            raise AssertionError(f"the test cannot read a {type(value).__name__}: teach snapshot() about it")
    if path is not None:
        state["files"] = _files(path)
    return state


def differences(a: Any, b: Any, where: str = "") -> list[str]:
    """Where two snapshots differ (tensors by dtype and exact values, NaN equal to NaN)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.dtype != b.dtype \
                or a.shape != b.shape or not torch.equal(torch.nan_to_num(a.float()), torch.nan_to_num(b.float())):
            return [f"{where}: tensors differ"]
        return []
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{where}.{k}: only on the {'apply' if k in a else 'cell'} side" for k in a.keys() ^ b.keys()]
        for k in a.keys() & b.keys():
            out += differences(a[k], b[k], f"{where}.{k}")
        return out
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}[{i}]")]
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return []
    return [] if a == b else [f"{where}: apply {a!r:.200} != cell {b!r:.200}"]


# Fixes whose cell acts relative to what it finds, by design: running it (or apply) again acts again.
RELATIVE = {"lower-learning-rate": "each run multiplies the learning rate it finds by the factor"}


# ---- the tests ---------------------------------------------------------------------------------
def test_every_fix_has_a_case():
    missing = sorted(set(fixes.FIXES) - set(CASES))
    assert not missing, (f"fixes without a case in tests/test_fix_cell_equals_apply.py: {missing}. Add one to CASES: "
                         "build the objects the fix acts on, so that this test can check that its cell does what "
                         "apply does")
    assert not set(CASES) - set(fixes.FIXES), f"cases for fixes that are not registered: {set(CASES) - set(fixes.FIXES)}"


PARAMS = [pytest.param(fix_id, i, id=f"{fix_id}-{i}",
                       marks=[pytest.mark.quant] if fix_id in CASES and CASES[fix_id][i].quant else [])
          for fix_id in sorted(fixes.FIXES) for i in range(len(CASES.get(fix_id, [None])))]


@pytest.mark.parametrize(("fix_id", "index"), PARAMS)
def test_the_cell_leaves_the_state_apply_leaves(fix_id, index, tmp_path):
    if fix_id not in CASES:
        pytest.fail(f"fix {fix_id!r} has no case: add one to CASES in tests/test_fix_cell_equals_apply.py")
    case = CASES[fix_id][index]
    if case.skip:
        pytest.skip(case.skip)
    options = case.options(tmp_path) if callable(case.options) else dict(case.options)
    path = options.get(case.writes) if case.writes else None
    start = _globals()
    try:
        before = snapshot(case.build(tmp_path), path)
        applied_world = case.build(tmp_path)
        torch.manual_seed(1)  # fixes that draw (mean_resizing) draw the same on both sides
        result = fixes.apply(fix_id, **{k: applied_world[k] for k in case.given},
                             names={k: k for k in case.given}, **options)
        applied = snapshot(applied_world, path)
        assert result.changed, f"case {index} of {fix_id!r} gives apply nothing to do: it checks nothing"
        assert differences(before, applied), f"apply of {fix_id!r} reported {result.changed} but changed no state read"
        _restore(start)
        if path is not None:
            shutil.rmtree(path, ignore_errors=True)
        cell_world = case.build(tmp_path)
        torch.manual_seed(1)
        exec(compile(result.code, f"<{fix_id} cell>", "exec"), {k: v for k, v in cell_world.items()})  # noqa: S102
        by_cell = snapshot(cell_world, path)
        # the fix holds once its cell ran: apply finds nothing left to do (a fix that writes files writes again)
        again = None if case.writes or fix_id in RELATIVE else \
            fixes.apply(fix_id, **{k: cell_world[k] for k in case.given}, **options).changed
    finally:
        _restore(start)
    found = differences(applied, by_cell)
    assert not found, f"{fix_id}: the cell and apply leave different state:\n" + "\n".join(sorted(found)[:30]) + \
        f"\n--- the cell ---\n{result.code}"
    assert not again, f"{fix_id}: after its cell ran, apply still changes {again}"
