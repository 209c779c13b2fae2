"""A dry forward that must return a loss, and classification heads that pool the wrong token: real Trainers."""
from __future__ import annotations

import pytest
import torch
from audit_helpers import make_args
from data_helpers import EOS, ListDataset, lm_trainer, ragged_examples, word_tokenizer

import nbguard
from nbguard.explainer import diagnose
from nbguard.testing import tiny_llama


def findings(result, rule_id: str):
    return [f for f in result.findings if f.rule == rule_id]


# ---- forward-returns-no-loss -----------------------------------------------------------------
def test_collator_without_labels_is_flagged_and_train_fails(tmp_path):
    from transformers import DataCollatorWithPadding

    tok = word_tokenizer(pad="unk")
    trainer = lm_trainer(tiny_llama(), make_args(tmp_path), ragged_examples(8), DataCollatorWithPadding(tok), tok)
    state = torch.get_rng_state()
    (f,) = findings(nbguard.audit(trainer=trainer), "forward-returns-no-loss")
    assert torch.equal(state, torch.get_rng_state())  # the dry forward drew nothing from the user's RNG
    assert f.severity.value == "error" and "labels" not in f.evidence["inputs"] and "logits" in f.evidence["returned"]
    with pytest.raises(ValueError) as raised:
        trainer.train()
    assert diagnose(raised.value).signature == "model-returned-no-loss"


def test_collator_with_labels_stays_quiet(tmp_path):
    tok = word_tokenizer(pad="unk")
    trainer = lm_trainer(tiny_llama(), make_args(tmp_path), ragged_examples(8), tokenizer=tok)
    assert not findings(nbguard.audit(trainer=trainer), "forward-returns-no-loss")
    trainer.train()  # the step the audit predicted works does work


def test_trainer_with_its_own_loss_is_not_dry_run(tmp_path):
    from transformers import DataCollatorWithPadding

    tok = word_tokenizer(pad="unk")
    trainer = lm_trainer(tiny_llama(), make_args(tmp_path), ragged_examples(8), DataCollatorWithPadding(tok), tok)
    trainer.compute_loss_func = lambda outputs, labels, num_items_in_batch=None: outputs.logits.mean()
    assert not findings(nbguard.audit(trainer=trainer), "forward-returns-no-loss")


# ---- classifier-pools-wrong-token ------------------------------------------------------------
def classifier(pad_id):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from nbguard.testing import TINY_VOCAB

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=TINY_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, num_labels=1, pad_token_id=pad_id)
    return LlamaForSequenceClassification(cfg)


def reward_trainer(tmp_path, model, tok, processing_class=True):
    from transformers import DataCollatorWithPadding, Trainer

    rows = [{**r, "labels": float(i % 2)} for i, r in enumerate(ragged_examples(8, eos=True))]
    return Trainer(model=model, args=make_args(tmp_path), train_dataset=ListDataset(rows),
                   data_collator=DataCollatorWithPadding(tok), processing_class=tok if processing_class else None)


def score(model, ids: list[int]) -> float:
    with torch.no_grad():
        return float(model(input_ids=torch.tensor([ids])).logits[0, 0])


def test_pad_equal_to_eos_pools_before_the_final_eos(tmp_path):
    tok = word_tokenizer(pad="eos")
    model = classifier(EOS)
    ids = ragged_examples(1)[0]["input_ids"]
    assert ids[-1] == EOS and score(model, ids) == score(model, ids[:-1])  # the final EOS is never read
    (f,) = findings(nbguard.audit(trainer=reward_trainer(tmp_path, model, tok)), "classifier-pools-wrong-token")
    assert f.evidence["pad_token_id_in_training"] == EOS and f.evidence["rows"]["count"] == 8
    assert f.fixes == ["distinct-pad-token"]


def test_lora_reward_model_is_read_through_peft(tmp_path):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(classifier(EOS), LoraConfig(r=4, target_modules=["q_proj"], task_type="SEQ_CLS"))
    trainer = reward_trainer(tmp_path, model, word_tokenizer(pad="eos"))
    (f,) = findings(nbguard.audit(trainer=trainer), "classifier-pools-wrong-token")
    assert f.evidence["rows"]["count"] == 8


def test_distinct_pad_pools_the_last_token_and_stays_quiet(tmp_path):
    tok = word_tokenizer(pad="unk")
    model = classifier(tok.pad_token_id)
    ids = ragged_examples(1)[0]["input_ids"]
    assert score(model, ids) != score(model, ids[:-1])  # the score is read at the final EOS
    trainer = reward_trainer(tmp_path, model, tok)
    assert not findings(nbguard.audit(trainer=trainer), "classifier-pools-wrong-token")
    trainer.train()


def test_tokenizer_pad_equal_to_eos_reaches_the_config_through_the_trainer(tmp_path):
    model = classifier(0)  # the config pads with <unk>, but the Trainer copies the tokenizer's pad (EOS) in
    trainer = reward_trainer(tmp_path, model, word_tokenizer(pad="eos"))
    (f,) = findings(nbguard.audit(trainer=trainer), "classifier-pools-wrong-token")
    assert f.evidence["set_by_trainer_from_tokenizer"] is True
    trainer.train()
    assert model.config.pad_token_id == EOS  # what the rule predicted the head would pool with


def test_no_pad_id_fails_in_a_step_and_the_fix_repairs_it(tmp_path):
    tok = word_tokenizer(pad="unk")
    trainer = reward_trainer(tmp_path, classifier(None), tok, processing_class=False)
    (f,) = findings(nbguard.audit(trainer=trainer), "classifier-pools-wrong-token")
    assert f.evidence["pad_token_id_in_training"] is None and f.fixes == ["sync-pad-token-id"]
    with pytest.raises(ValueError) as raised:
        trainer.train()
    assert diagnose(raised.value).signature == "classifier-no-pad-token"

    assert nbguard.fixes.apply("sync-pad-token-id", trainer=trainer, tokenizer=tok).changed
    assert not findings(nbguard.audit(trainer=trainer), "classifier-pools-wrong-token")
    trainer.train()


def test_left_padding_with_a_distinct_pad_pools_the_last_token_and_stays_quiet(tmp_path):
    """transformers 5 pools the rightmost non-pad token, so left padding scores the same token as right padding."""
    from transformers import DataCollatorWithPadding

    tok = word_tokenizer(pad="unk", padding_side="left")
    model = classifier(tok.pad_token_id)
    rows = ragged_examples(2)
    left = DataCollatorWithPadding(tok)(rows)
    with torch.no_grad():
        scores = model(**left).logits[:, 0]
    assert scores.tolist() == pytest.approx([score(model, r["input_ids"]) for r in rows], abs=1e-5)
    assert not findings(nbguard.audit(trainer=reward_trainer(tmp_path, model, tok)), "classifier-pools-wrong-token")


def test_dry_forward_leaves_a_4bit_model_as_found(tmp_path):
    """An eval-mode forward would make bitsandbytes repack the 4-bit weights for CPU inference (different numerics
    for the training that follows): the dry forward runs in training mode and puts every module's flag back."""
    from peft import LoraConfig, get_peft_model

    from nbguard.testing import tiny_4bit

    model = get_peft_model(tiny_4bit("llama", compute_dtype=torch.bfloat16, dtype=torch.bfloat16),
                           LoraConfig(r=4, target_modules=["q_proj"]))
    model.eval()  # as from_pretrained leaves it: the Trainer only calls train() inside train()
    before = {n: (p.shape, p.dtype) for n, p in model.named_parameters()}
    modes = [m.training for m in model.modules()]
    trainer = lm_trainer(model, make_args(tmp_path), ragged_examples(8), tokenizer=word_tokenizer(pad="unk"))
    assert not findings(nbguard.audit(trainer=trainer), "forward-returns-no-loss")
    assert {n: (p.shape, p.dtype) for n, p in model.named_parameters()} == before
    assert [m.training for m in model.modules()] == modes


# ---- a forward that crashes on parameters of two dtypes (axolotl's bf16: auto without bf16) ------------------
def _mixed_dtype_trainer(tmp_path, own_loss: bool):
    from transformers import Trainer

    tok = word_tokenizer(pad="unk")
    model = tiny_llama(dtype=torch.float16)
    model.lm_head.float()  # float32 modules in a float16 model, no autocast: the matmul's dtypes differ
    trainer = lm_trainer(model, make_args(tmp_path), ragged_examples(8), tokenizer=tok)
    if own_loss:  # a framework's Trainer with its own compute_loss (axolotl's)
        class FrameworkTrainer(Trainer):
            def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
                return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

        trainer.__class__ = FrameworkTrainer
    return trainer


@pytest.mark.parametrize("own_loss", [False, True], ids=["Trainer", "framework's compute_loss"])
def test_a_forward_that_crashes_on_mixed_dtypes_is_predicted_with_the_dtypes_named(tmp_path, own_loss):
    trainer = _mixed_dtype_trainer(tmp_path, own_loss)
    result = nbguard.audit(trainer=trainer)
    assert not [f for f in result.findings if f.rule == "rule-error"]  # (it was "rule weights-not-loaded could not run")
    (f,) = findings(result, "forward-returns-no-loss")
    assert f.severity.value == "error" and f.title == "the model's forward fails on the trainer's batches"
    assert "float16" in f.detail and "float32: 1 (lm_head.weight)" in f.detail
    with pytest.raises(RuntimeError) as raised:
        trainer.train()
    assert str(raised.value) in f.evidence["exception"]  # the crash the audit predicted, word for word
