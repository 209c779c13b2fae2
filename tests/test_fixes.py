"""Each fix: the finding is gone after apply, a second apply changes nothing, and the generated cell
(exec'd with the caller's own variable names) has exactly the same effect as apply."""
from __future__ import annotations

import re

import pytest
import torch
from audit_helpers import (
    add_zero_tokens,
    healthy_peft_model,
    make_args,
    make_trainer,
    param_dtypes,
    seed_peft_model,
    state_copy,
    tiny_gemma3_multimodal,
)

import nbguard
import nbguard.fixes as fixes
from nbguard.session import SESSION
from nbguard.testing import tiny_batch, tiny_gemma3, tiny_llama


def run_cell(cell: str, **namespace):
    exec(compile(cell, "<nbguard fix cell>", "exec"), namespace)
    return namespace


def same_state(a, b) -> bool:
    sa, sb = state_copy(a), state_copy(b)
    return sa.keys() == sb.keys() and all(sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]) for k in sa)


# ---- registry ---------------------------------------------------------------------------------
def test_registry_lists_the_fixes_of_the_issue():
    assert {"upcast-trainable-fp32", "disable-use-cache", "init-new-embeddings", "enable-grad-clipping",
            "enable-input-require-grads", "switch-precision", "lower-learning-rate"} <= set(fixes.available())
    fix = fixes.get("switch-precision")
    assert fix.id == "switch-precision" and fix.title and fix.description and callable(fix.apply)


def test_unknown_fix_id_lists_the_valid_ones():
    with pytest.raises(ValueError, match="unknown fix id 'make-it-work'.*upcast-trainable-fp32"):
        fixes.apply("make-it-work", model=tiny_llama())
    with pytest.raises(ValueError, match="valid ids"):
        fixes.code("make-it-work")


def test_bad_targets_and_names_are_named():
    with pytest.raises(ValueError, match="needs model="):
        fixes.apply("upcast-trainable-fp32")
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        fixes.apply("upcast-trainable-fp32", model="model")
    with pytest.raises(ValueError, match="needs trainer=, args= .* or optimizer= \\(a torch optimizer\\)"):
        fixes.apply("enable-grad-clipping", model=tiny_llama())  # a plain loop's clipping acts on its optimizer
    with pytest.raises(ValueError, match="model must be a variable name"):
        fixes.code("upcast-trainable-fp32", model="os.system('x')")


def test_apply_records_the_fix_in_the_session():
    result = fixes.apply("upcast-trainable-fp32", model=seed_peft_model())
    assert SESSION.fixes_applied[-1]["fix"] == "upcast-trainable-fp32"
    assert SESSION.fixes_applied[-1]["changed"] == result.changed and result.code
    assert result.to_dict()["fix"] == "upcast-trainable-fp32" and result.changed_anything


# ---- upcast-trainable-fp32 -------------------------------------------------------------------
def test_upcast_trainable_fp32():
    model = seed_peft_model()
    assert "trainable-low-precision" in nbguard.audit(model, hardware="a100")
    first = fixes.apply("upcast-trainable-fp32", model=model)
    # a model without a Trainer is a plain loop's: its half inputs are cast to the weights' float32 too
    assert first.changed.pop("inputs") == "float16/bfloat16 inputs become float32 before each forward outside autocast"
    assert len(first.changed) == 12 and all(v == "bfloat16 -> float32" for v in first.changed.values())
    assert "trainable-low-precision" not in nbguard.audit(model, hardware="a100")
    assert fixes.apply("upcast-trainable-fp32", model=model).changed == {}
    frozen = [p.dtype for p in model.parameters() if not p.requires_grad]
    assert set(frozen) == {torch.bfloat16}  # frozen weights untouched

    other = seed_peft_model()
    cell = fixes.code("upcast-trainable-fp32", model="my_model")
    assert "my_model" in cell and "nbguard" not in cell
    run_cell(cell, my_model=other)
    assert param_dtypes(other) == param_dtypes(model) and same_state(other, model)


def test_model_cells_reach_the_model_through_a_trainer(tmp_path):
    trainer = make_trainer(seed_peft_model(), make_args(tmp_path))
    cell = fixes.code("upcast-trainable-fp32", trainer="my_trainer")
    assert "my_trainer.model.named_parameters()" in cell
    run_cell(cell, my_trainer=trainer)
    assert "trainable-low-precision" not in nbguard.audit(trainer=trainer, hardware="a100")
    assert fixes.apply("upcast-trainable-fp32", trainer=trainer).changed == {}


# ---- init-new-embeddings ---------------------------------------------------------------------
@pytest.mark.parametrize("build", [
    lambda: seed_peft_model(),  # Gemma 3, tied, LoRA on embed_tokens + lm_head
    lambda: seed_peft_model("llama", target_modules=["q_proj"], modules_to_save=["embed_tokens", "lm_head"]),
    lambda: seed_peft_model(target_modules=["q_proj"], trainable_token_indices={"embed_tokens": [128, 130, 135]}),
    lambda: add_zero_tokens(tiny_llama()),
], ids=["lora-embeddings", "modules-to-save", "trainable-tokens", "plain"])
def test_init_new_embeddings(build):
    model = build()
    assert "zero-embedding-rows" in nbguard.audit(model, hardware="a100")
    assert fixes.apply("init-new-embeddings", model=model).changed
    assert "zero-embedding-rows" not in nbguard.audit(model, hardware="a100")
    assert fixes.apply("init-new-embeddings", model=model).changed == {}
    emb = model.get_input_embeddings()
    assert emb(torch.tensor([[0]])).abs().sum() == 0  # the padding row stays zero

    other = build()
    run_cell(fixes.code("init-new-embeddings", model="peft_model"), peft_model=other)
    assert same_state(other, model)


def test_init_new_embeddings_uses_the_mean_of_trained_rows():
    model = add_zero_tokens(tiny_llama())
    trained = model.get_input_embeddings().weight[1:128].detach().float().mean(dim=0)
    fixes.apply("init-new-embeddings", model=model)
    assert torch.allclose(model.get_input_embeddings().weight[130], trained)


# ---- disable-use-cache -----------------------------------------------------------------------
def test_disable_use_cache(tmp_path):
    args = make_args(tmp_path, gradient_checkpointing=True)
    model = tiny_gemma3()
    assert "cache-with-checkpointing" in nbguard.audit(model, args=args, hardware="a100")
    assert fixes.apply("disable-use-cache", model=model).changed == {"config.use_cache": "True -> False"}
    assert "cache-with-checkpointing" not in nbguard.audit(model, args=args, hardware="a100")
    assert fixes.apply("disable-use-cache", model=model).changed == {}
    other = tiny_gemma3()
    run_cell(fixes.code("disable-use-cache", model="m"), m=other)
    assert other.config.use_cache is False


def test_disable_use_cache_reaches_the_text_config_of_multimodal_gemma3(tmp_path):
    args = make_args(tmp_path, gradient_checkpointing=True)
    model = tiny_gemma3_multimodal()
    assert model.config.text_config is not model.config and model.config.text_config.use_cache
    assert "cache-with-checkpointing" in nbguard.audit(model, args=args, hardware="a100")
    changed = fixes.apply("disable-use-cache", model=model).changed
    assert changed == {"config.text_config.use_cache": "True -> False"}
    assert "cache-with-checkpointing" not in nbguard.audit(model, args=args, hardware="a100")
    model.config.text_config.use_cache = True
    run_cell(fixes.code("disable-use-cache", model="vlm"), vlm=model)
    assert model.config.text_config.use_cache is False


# ---- enable-grad-clipping --------------------------------------------------------------------
def test_enable_grad_clipping(tmp_path):
    trainer = make_trainer(tiny_llama(), make_args(tmp_path, fp16=False, max_grad_norm=0.0))
    args = make_args(tmp_path, fp16=True, max_grad_norm=0.0)
    assert "no-grad-clipping" in nbguard.audit(tiny_llama(), args=args, hardware="t4")
    assert fixes.apply("enable-grad-clipping", args=args).changed == {"args.max_grad_norm": "0.0 -> 1.0"}
    assert "no-grad-clipping" not in nbguard.audit(tiny_llama(), args=args, hardware="t4")
    assert fixes.apply("enable-grad-clipping", args=args).changed == {}
    cell = fixes.code("enable-grad-clipping", trainer="sft_trainer")
    run_cell(cell, sft_trainer=trainer)
    assert trainer.args.max_grad_norm == 1.0


# ---- enable-input-require-grads --------------------------------------------------------------
def _broken_checkpointing():
    model = healthy_peft_model()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    if getattr(model, "_require_grads_hook", None) is not None:  # recent transformers add it themselves
        model.disable_input_require_grads()
    model.train()
    return model


def test_enable_input_require_grads():
    model = _broken_checkpointing()
    assert "checkpointing-no-input-grads" in nbguard.audit(model, hardware="a100")
    assert fixes.apply("enable-input-require-grads", model=model).changed
    assert "checkpointing-no-input-grads" not in nbguard.audit(model, hardware="a100")
    assert fixes.apply("enable-input-require-grads", model=model).changed == {}
    model(**tiny_batch(2, 8)).loss.backward()  # the error is gone: adapters get gradients
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)

    other = _broken_checkpointing()
    cell = fixes.code("enable-input-require-grads", model="lora_model")
    run_cell(cell, lora_model=other)
    run_cell(cell, lora_model=other)  # running the cell twice does not stack hooks
    assert "checkpointing-no-input-grads" not in nbguard.audit(other, hardware="a100")
    hooks = sum(len(m._forward_hooks) for m in other.modules())
    assert hooks == sum(len(m._forward_hooks) for m in model.modules())


# ---- switch-precision ------------------------------------------------------------------------
def test_switch_precision_on_model_and_args(tmp_path):
    args, model = make_args(tmp_path, fp16=True), tiny_gemma3(dtype=torch.float16)
    assert "fp16-overflow-risk" in nbguard.audit(model, args=args, hardware="t4")
    changed = fixes.apply("switch-precision", model=model, args=args, to="fp32").changed
    assert changed["to"] == "fp32" and changed["args.fp16"] == "True -> False"
    assert args.fp16 is False and args.bf16 is False and getattr(args, "mixed_precision", "no") == "no"
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert "fp16-overflow-risk" not in nbguard.audit(model, args=args, hardware="t4")
    assert fixes.apply("switch-precision", model=model, args=args, to="fp32").changed == {}

    other_args, other = make_args(tmp_path, fp16=True), tiny_gemma3(dtype=torch.float16)
    run_cell(fixes.code("switch-precision", model="m", args="a", to="fp32"), m=other, a=other_args)
    assert same_state(other, model)
    assert (other_args.fp16, other_args.bf16, getattr(other_args, "mixed_precision", "no")) == (False, False, "no")


def test_switch_precision_cell_for_a_plain_loop_touches_only_the_model():
    """No trainer or args in a plain PyTorch loop: the cell must not reference names that don't exist."""
    model, other = tiny_gemma3(dtype=torch.float16), tiny_gemma3(dtype=torch.float16)
    result = nbguard.audit(model, hardware="t4")
    cell = result.to_document(names={"model": "net"})["fix_cells"]["switch-precision"]["code"]
    # no name the loop lacks (the input-cast hook's with_kwargs=True is torch's keyword, not a variable)
    assert not re.search(r"\b(trainer|args)\b", cell) and "net" in cell
    run_cell(cell, net=other)  # a NameError here is the bug this guards against
    assert {p.dtype for p in other.parameters()} == {torch.float32}
    recorded = fixes.apply("switch-precision", model=model, to="fp32").code
    assert not re.search(r"\b(trainer|args)\b", recorded)
    with pytest.raises(ValueError, match="changes TrainingArguments"):
        fixes.code("enable-grad-clipping", model="net")


def test_switch_precision_to_bf16_keeps_trainable_weights_fp32(tmp_path):
    args, model = make_args(tmp_path, fp16=True), tiny_gemma3(dtype=torch.float16)
    fixes.apply("switch-precision", model=model, args=args, to="bf16")
    assert (args.fp16, args.bf16, getattr(args, "mixed_precision", "bf16")) == (False, True, "bf16")
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # all trainable here
    assert "fp16-overflow-risk" not in nbguard.audit(model, args=args, hardware="l4")
    with pytest.raises(ValueError, match="to must be 'bf16', 'fp32' or None"):
        fixes.apply("switch-precision", args=args, to="fp8")


def test_switch_precision_default_is_best_for_the_hardware(tmp_path):
    args = make_args(tmp_path, fp16=True)
    assert fixes.apply("switch-precision", args=args, hardware="t4").changed["to"] == "fp32"
    args = make_args(tmp_path, fp16=True)
    assert fixes.apply("switch-precision", args=args, hardware="a100").changed["to"] == "bf16"


def test_switch_precision_rebuilds_the_trainers_accelerator(tmp_path):
    # bf16 asked for on a T4: the trainer's accelerator already runs bf16 autocast; fp32 must rebuild it.
    trainer = make_trainer(healthy_peft_model(), make_args(tmp_path, bf16=True))
    trainer.train()  # prepare() has wrapped the model's forward in bf16 autocast
    assert trainer.accelerator.mixed_precision == "bf16" and hasattr(trainer.model, "_original_forward")
    assert "bf16-unsupported" in nbguard.audit(trainer=trainer, hardware="t4")
    changed = fixes.apply("switch-precision", trainer=trainer, to="fp32").changed
    assert changed["trainer.accelerator.mixed_precision"] == "bf16 -> no"
    assert trainer.accelerator.mixed_precision == "no" and not hasattr(trainer.model, "_original_forward")
    assert "bf16-unsupported" not in nbguard.audit(trainer=trainer, hardware="t4")
    seen = []  # inside the forward: no bf16 autocast is left over from the old accelerator
    q_proj = trainer.model.get_submodule("base_model.model.model.layers.0.self_attn.q_proj.base_layer")
    handle = q_proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    trainer.model(**tiny_batch(1, 8))
    handle.remove()
    assert seen == [torch.float32]
    trainer.train()  # and it still trains
    assert fixes.apply("switch-precision", trainer=trainer, to="fp32").changed == {}


def test_switch_precision_cell_on_a_trainer(tmp_path):
    trainer = make_trainer(healthy_peft_model(), make_args(tmp_path, bf16=True))
    cell = fixes.code("switch-precision", trainer="my_trainer", to="fp32")
    assert "my_trainer.create_accelerator_and_postprocess()" in cell and "nbguard" not in cell
    run_cell(cell, my_trainer=trainer)
    assert trainer.accelerator.mixed_precision == "no" and trainer.args.bf16 is False
    trainer.train()


# ---- lower-learning-rate ---------------------------------------------------------------------
def test_lower_learning_rate_on_a_built_trainer(tmp_path):
    trainer = make_trainer(tiny_llama(), make_args(tmp_path, learning_rate=1e-3, max_steps=4))
    trainer.create_optimizer_and_scheduler(num_training_steps=4)
    changed = fixes.apply("lower-learning-rate", trainer=trainer).changed
    assert changed["args.learning_rate"] == "0.001 -> 0.0001"
    assert trainer.args.learning_rate == pytest.approx(1e-4)
    assert all(g["lr"] == pytest.approx(1e-4) for g in trainer.optimizer.param_groups)
    assert trainer.lr_scheduler.base_lrs == pytest.approx([1e-4] * len(trainer.lr_scheduler.base_lrs))
    assert fixes.apply("lower-learning-rate", trainer=trainer).changed == {}  # idempotent
    assert trainer.args.learning_rate == pytest.approx(1e-4)

    other = make_trainer(tiny_llama(), make_args(tmp_path, learning_rate=1e-3, max_steps=4))
    other.create_optimizer_and_scheduler(num_training_steps=4)
    run_cell(fixes.code("lower-learning-rate", trainer="t"), t=other)
    assert other.args.learning_rate == pytest.approx(1e-4)
    assert [g["lr"] for g in other.optimizer.param_groups] == pytest.approx(
        [g["lr"] for g in trainer.optimizer.param_groups])
    assert other.lr_scheduler.base_lrs == pytest.approx(trainer.lr_scheduler.base_lrs)


# ---- drop-unsupervised-rows -------------------------------------------------------------------
def _trainer_with_unsupervised_rows(tmp_path, dropped=(1, 4)):
    trainer = make_trainer(tiny_llama(), make_args(tmp_path), rows=6)
    rows = trainer.train_dataset.rows
    for i in dropped:
        rows[i]["labels"][1:] = -100  # only the first label, which the causal shift drops, is left
    return trainer


def test_drop_unsupervised_rows_filters_the_trainers_data(tmp_path):
    trainer = _trainer_with_unsupervised_rows(tmp_path)
    kept = [r for i, r in enumerate(trainer.train_dataset.rows) if i not in (1, 4)]
    result = fixes.apply("drop-unsupervised-rows", trainer=trainer, names={"trainer": "my_trainer"})
    assert result.changed == {"trainer.train_dataset": "6 -> 4 rows"}
    assert [r["input_ids"].tolist() for r in trainer.train_dataset] == [r["input_ids"].tolist() for r in kept]
    assert not fixes.apply("drop-unsupervised-rows", trainer=trainer).changed  # idempotent
    # the cell has the same effect on another trainer, under the caller's name
    other = _trainer_with_unsupervised_rows(tmp_path)
    run_cell(result.code, my_trainer=other)
    assert [r["input_ids"].tolist() for r in other.train_dataset] == [r["input_ids"].tolist() for r in kept]
    other.train()  # the filtered list still trains


def test_drop_unsupervised_rows_refuses_to_leave_no_data(tmp_path):
    trainer = _trainer_with_unsupervised_rows(tmp_path, dropped=range(6))
    with pytest.raises(ValueError, match="nothing to train on"):
        fixes.apply("drop-unsupervised-rows", trainer=trainer)
    assert len(trainer.train_dataset) == 6


@pytest.mark.parametrize("through", ["apply", "cell"])
def test_switch_precision_after_training_lets_the_same_trainer_train_again(tmp_path, through):
    """A trainer that already stepped keeps its optimizer: its fp16 moments must follow the fp32 weights, or
    the next train() fails on a fused update over mixed dtypes."""
    from data_helpers import ListDataset, word_tokenizer
    from transformers import DataCollatorForLanguageModeling, Trainer

    rows = [{"input_ids": [1, *range(5 + i, 12 + i), 2]} for i in range(8)]
    args = make_args(tmp_path, per_device_train_batch_size=2, max_steps=2, save_strategy="no")
    trainer = Trainer(model=tiny_llama(dtype=torch.float16), args=args, train_dataset=ListDataset(rows),
                      data_collator=DataCollatorForLanguageModeling(word_tokenizer(), mlm=False))
    trainer.train()
    assert {v.dtype for s in trainer.optimizer.state.values() for k, v in s.items() if k != "step"} == {torch.float16}
    if through == "apply":
        changed = fixes.apply("switch-precision", trainer=trainer, to="fp32").changed
        assert "optimizer_state" in changed
    else:
        run_cell(fixes.code("switch-precision", trainer="t", model="t.model", args="t.args", to="fp32"), t=trainer)
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}
    assert {v.dtype for s in trainer.optimizer.state.values() for k, v in s.items() if k != "step"} == {torch.float32}
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.args.max_steps = 4
    trainer.train()  # raised "Tensors of the same index must be on the same device and the same dtype" before
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
