"""Assistant-only loss coverage per role and double BOS, on real TRL SFTTrainers over an in-process tokenizer."""
from __future__ import annotations

import pytest
import torch
from chat_helpers import (
    BOS_ID,
    EMPTY_THINK,
    EVERYTHING_GENERATED,
    WITH_GENERATION,
    WITHOUT_GENERATION,
    chat_tokenizer,
    conversation,
)

import nbguard
from nbguard.auditor.context import AuditContext
from nbguard.auditor.rules.chat_loss import role_supervision, sampled_role_supervision
from nbguard.explainer import diagnose, diagnose_warning
from nbguard.testing import tiny_llama


def sft_trainer(tmp_path, tok, rows, **config):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=1, per_device_train_batch_size=2,
                     save_strategy="no", disable_tqdm=True, max_length=64, **config)
    return SFTTrainer(model=tiny_llama(), args=args, processing_class=tok, train_dataset=Dataset.from_list(rows))


def chats(n: int = 4) -> list[dict]:
    return [{"messages": conversation(seed=i)} for i in range(n)]


def rule_findings(result, rule_id: str):
    return [f for f in result.findings if f.rule == rule_id]


def supervised_ids(trainer) -> set[int]:
    batch = next(iter(trainer.get_train_dataloader()))
    return set(batch["input_ids"][batch["labels"] != -100].tolist())


def user_markers(tok) -> set[int]:
    return {tok.convert_tokens_to_ids("<|user|>"), tok.convert_tokens_to_ids("<|system|>")}


# ---- assistant-loss-coverage -----------------------------------------------------------------
def test_healthy_template_supervises_only_the_assistant_and_stays_quiet(tmp_path):
    tok = chat_tokenizer(WITH_GENERATION)
    trainer = sft_trainer(tmp_path, tok, chats(), assistant_only_loss=True)
    assert not supervised_ids(trainer) & user_markers(tok)  # the real batches train on the replies only
    seen = role_supervision(tok, WITH_GENERATION)
    assert seen.supervised["user"] == seen.supervised["system"] == 0 and seen.share("assistant") > 0.8
    ctx = AuditContext(model=trainer.model, trainer=trainer, args=trainer.args)
    sampled, rows = sampled_role_supervision(ctx, WITH_GENERATION)  # the trainer's own rows, read back
    assert rows == 4 and sampled.supervised["user"] == sampled.supervised["system"] == 0
    assert sampled.share("assistant") > 0.8
    assert not rule_findings(nbguard.audit(trainer=trainer), "assistant-loss-coverage")


def test_template_around_everything_is_flagged_and_trains_on_the_user(tmp_path):
    tok = chat_tokenizer(EVERYTHING_GENERATED)
    trainer = sft_trainer(tmp_path, tok, chats(), assistant_only_loss=True)
    assert user_markers(tok) <= supervised_ids(trainer)  # the degradation: the real labels supervise the user's turns
    (f,) = rule_findings(nbguard.audit(trainer=trainer), "assistant-loss-coverage")
    assert f.severity.value == "warning" and "user" in f.title and f.evidence["per_role_source"] == "sampled rows"
    assert f.evidence["per_role"]["user"]["share"] == 1.0 and f.evidence["per_role"]["system"]["share"] > 0.8
    assert f.evidence["probe_per_role"]["user"]["share"] == 1.0  # the probe conversation agrees


def test_empty_think_block_inside_the_generation_block_is_flagged(tmp_path):
    tok = chat_tokenizer(EMPTY_THINK)
    trainer = sft_trainer(tmp_path, tok, chats(), assistant_only_loss=True)
    think = {tok.convert_tokens_to_ids("<think>"), tok.convert_tokens_to_ids("</think>")}
    assert think <= supervised_ids(trainer)  # the model is taught to open and close an empty think block
    (f,) = rule_findings(nbguard.audit(trainer=trainer), "assistant-loss-coverage")
    assert f.evidence["per_role_source"] == "sampled rows" and f.evidence["sampled_rows"] == 4
    assert f.evidence["empty_think_supervised"] == 16 and "think" in f.title  # 4 rows x 2 replies x 2 tokens
    assert f.evidence["per_role"]["user"]["supervised"] == 0


def test_template_without_generation_fails_in_trl_and_the_audit_says_it_masks_nothing(tmp_path):
    tok = chat_tokenizer(WITHOUT_GENERATION)
    with pytest.raises(ValueError) as raised:  # TRL has no training version of this template
        sft_trainer(tmp_path, tok, chats(), assistant_only_loss=True)
    diagnosis = diagnose(raised.value)
    assert diagnosis is not None and diagnosis.signature == "assistant-mask-no-generation"
    # The trainer's rows were built with a good template: the audit reads them back and stays quiet.
    trainer = sft_trainer(tmp_path, chat_tokenizer(WITH_GENERATION), chats(), assistant_only_loss=True)
    trainer.processing_class.chat_template = WITHOUT_GENERATION
    assert not rule_findings(nbguard.audit(trainer=trainer), "assistant-loss-coverage")
    # Rows that cannot be read back (tokenised on the fly, no "messages" column): the template decides alone.
    trainer.train_dataset = trainer.train_dataset.remove_columns("messages")
    (f,) = rule_findings(nbguard.audit(trainer=trainer), "assistant-loss-coverage")
    assert f.severity.value == "error" and f.evidence["per_role"]["assistant"]["supervised"] == 0
    assert f.evidence["per_role_source"] == "probe conversation" and f.evidence["generation_markers"] is False


def test_transformers_warning_without_generation_has_a_signature(caplog):
    import logging

    from transformers.utils import logging as hf_logging

    tok = chat_tokenizer(WITHOUT_GENERATION)
    logging.Logger.warning_once.cache_clear()  # type: ignore[attr-defined]  # emitted once per process otherwise
    hf_logging.enable_propagation()
    try:
        with caplog.at_level("WARNING"):
            out = tok.apply_chat_template(conversation(), tokenize=True, return_dict=True,
                                          return_assistant_tokens_mask=True)
    finally:
        hf_logging.disable_propagation()
    assert sum(out["assistant_masks"]) == 0
    (text,) = {r.getMessage() for r in caplog.records if "generation" in r.getMessage()}
    diagnosis = diagnose_warning(text, "transformers")
    assert diagnosis is not None and diagnosis.signature == "generation-keyword-missing"


def test_coverage_rule_is_silent_without_assistant_only_loss(tmp_path):
    trainer = sft_trainer(tmp_path, chat_tokenizer(EVERYTHING_GENERATED), chats())
    assert not rule_findings(nbguard.audit(trainer=trainer), "assistant-loss-coverage")


# ---- double-bos ------------------------------------------------------------------------------
def text_rows(tok, n: int = 4) -> list[dict]:
    """Conversations rendered to text by the template (which writes <s>), the way a text-field SFT recipe does."""
    return [{"text": tok.apply_chat_template(conversation(seed=i), tokenize=False)} for i in range(n)]


def first_token_loss(model, ids: list[int]) -> float:
    batch = torch.tensor([ids])
    labels = batch.clone()
    labels[:, : len(ids) - 6] = -100  # the same answer tokens are scored in both
    with torch.no_grad():
        return float(model(input_ids=batch, labels=labels).loss)


def test_double_bos_from_template_plus_tokenizer_is_flagged(tmp_path):
    tok = chat_tokenizer(WITH_GENERATION, add_bos=True)
    trainer = sft_trainer(tmp_path, tok, text_rows(tok))
    batch = next(iter(trainer.get_train_dataloader()))
    assert (batch["input_ids"][:, :2] == BOS_ID).all()  # TRL tokenised the templated text with the BOS added
    (f,) = rule_findings(nbguard.audit(trainer=trainer), "double-bos")
    assert f.evidence["template_renders_bos_and_tokenizer_adds_one"] is True
    assert f.evidence["rows"]["count"] == 4 and f.fixes == ["drop-doubled-bos", "tokenizer-no-bos"]
    assert "dataset_kwargs={'add_special_tokens'" not in f.detail  # TRL 1.16 tokenizes the text field regardless
    # The step differs: the same answer scored after one BOS or two.
    model, ids = tiny_llama(), batch["input_ids"][0][batch["attention_mask"][0].bool()].tolist()
    assert first_token_loss(model, ids) != pytest.approx(first_token_loss(model, ids[1:]), rel=1e-4)

    result = nbguard.fixes.apply("tokenizer-no-bos", tokenizer=tok)
    assert result.changed and tok(text_rows(tok, 1)[0]["text"])["input_ids"][:2] == [BOS_ID, 3]
    rebuilt = sft_trainer(tmp_path, tok, text_rows(tok))
    assert not rule_findings(nbguard.audit(trainer=rebuilt), "double-bos")


def test_drop_doubled_bos_fixes_the_trainer_as_built_and_its_cell_does_the_same(tmp_path):
    """The fix acts on TRL's prepared rows, so the trainer the user already built is repaired: re-audited on
    its own dataloader's batches, quiet; the cell, run as written on a second trainer, does the same."""
    tok = chat_tokenizer(WITH_GENERATION, add_bos=True)
    trainer = sft_trainer(tmp_path, tok, text_rows(tok))
    before = [list(r) for r in trainer.train_dataset["input_ids"]]
    applied = nbguard.fixes.apply("drop-doubled-bos", trainer=trainer)
    assert applied.changed == {"trainer.train_dataset": "4 of 4 rows start with one BOS instead of two"}
    after = [list(r) for r in trainer.train_dataset["input_ids"]]
    assert after == [r[1:] for r in before] and all(r[0] == BOS_ID != r[1] for r in after)
    assert not rule_findings(nbguard.audit(trainer=trainer), "double-bos")
    trainer.train()  # the repaired rows train (the aligned columns kept their lengths)

    other = sft_trainer(tmp_path / "cell", tok, text_rows(tok))
    code = nbguard.fixes.code("drop-doubled-bos", trainer="other")
    exec(compile(code, "<fix cell>", "exec"), {"other": other})
    assert not rule_findings(nbguard.audit(trainer=other), "double-bos")


def test_tokenizer_no_bos_reads_what_the_tokenizer_does_not_its_flag():
    """A Llama-3-style tokenizer adds BOS in its post-processor with add_bos_token False: the fix still stops it
    (the flag's setter rebuilds the post-processor), and says what changed instead of returning nothing."""
    from tokenizers.processors import TemplateProcessing

    tok = chat_tokenizer(WITH_GENERATION, add_bos=False)
    tok._tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS_ID)])
    assert tok("w9")["input_ids"] == [BOS_ID, 9] and tok.add_bos_token is False
    applied = nbguard.fixes.apply("tokenizer-no-bos", tokenizer=tok)
    assert applied.changed == {"tokenizer.add_bos_token":
                               "False -> False: encoding no longer adds BOS (the chat template writes it)"}
    assert tok("w9")["input_ids"] == [9]
    assert nbguard.fixes.apply("tokenizer-no-bos", tokenizer=tok).changed == {}  # holds now: nothing to do


def test_single_bos_from_the_template_stays_quiet(tmp_path):
    tok = chat_tokenizer(WITH_GENERATION, add_bos=False)
    trainer = sft_trainer(tmp_path, tok, text_rows(tok))
    assert not rule_findings(nbguard.audit(trainer=trainer), "double-bos")
