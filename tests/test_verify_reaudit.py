"""Data and config fixes verified by a re-audit on the trainer as built (issue 30 item 3), on real trainers.

``nbguard.audit(trainer=..., verify=True)`` applies each fix without a step recipe to a shadow of the trainer
(its processing class and collator copied together, its args copied, the model never copied), re-runs the rules
that raised the finding on batches from the shadow's own dataloader, and says "verified" when they no longer
fire, "not enough" when they do. The user's tokenizer, collator, args, datasets and model stay as they were.
"""
from __future__ import annotations

import tempfile

import pytest
import torch
from audit_helpers import make_args
from chat_helpers import BOS_ID, WITH_GENERATION, chat_tokenizer, conversation
from data_helpers import EOS, ListDataset, lm_trainer, ragged_examples, word_tokenizer

import nbguard
from nbguard.document.view import REAUDITED
from nbguard.testing import TINY_VOCAB, tiny_llama
from nbguard.verifier.reaudit import MODEL_REASON, reauditable
from nbguard.verifier.result import NOT_CHECKED, NOT_ENOUGH, VERIFIED

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")


def verdict(result, fix_id: str):
    found = result.verification.verdict(fix_id)
    assert found is not None, f"{fix_id} has no verdict: {result.verification}"
    return found


def html(result) -> str:
    return result._repr_mimebundle_()["text/html"]


def rules(result) -> set[str]:
    return {f.rule for f in result.findings}


# ---- which fixes a re-audit checks ---------------------------------------------------------------------------------
def test_the_plan_less_data_and_config_fixes_are_the_ones_re_audited():
    from nbguard.fixes.registry import FIXES

    assert sorted(k for k in FIXES if reauditable(k)) == [
        "add-entropy-bonus", "add-warmup", "distinct-pad-token", "drop-doubled-bos", "drop-mask-for-packing",
        "drop-rows", "drop-truncated-rows", "enable-router-aux-loss", "finite-rewards", "full-vocabulary-sampling",
        "lower-beta", "mask-special-labels", "match-sampling-settings", "raise-temperature", "scale-loss-for-accumulation", "sync-pad-token-id",
        "tokenizer-no-bos", "unshift-labels"]
    # a fix with a step recipe keeps it; one that changes modules, files or process state is never re-audited
    assert not reauditable("drop-unsupervised-rows") and not reauditable("pad-right-for-training")
    assert not any(reauditable(k) for k in ("model-train-mode", "dropout-train-mode", "save-tokenizer",
                                            "disable-cudnn-sdp", "resize-token-embeddings"))


# ---- (1) a plain Trainer whose tokenizer pads with EOS ---------------------------------------------------------------
def pad_is_eos_trainer(tmp_path):
    tok = word_tokenizer(pad="eos")
    model = tiny_llama()
    model.config.pad_token_id = EOS  # as a notebook that copied the tokenizer's pad id does
    return lm_trainer(model, make_args(tmp_path), ragged_examples(16), tokenizer=tok), tok


def snapshot(trainer) -> dict:
    """What a data fix could change on the user's objects, read off them."""
    tok, collator = trainer.processing_class, trainer.data_collator
    batch = next(iter(trainer.get_train_dataloader()))
    return {"tokenizer": tok, "pad": (tok.pad_token, tok.pad_token_id, len(tok)), "collator": collator,
            "collator_tokenizer": getattr(collator, "tokenizer", None),
            "collator_pad": getattr(collator, "pad_token_id", None), "args": trainer.args,
            "args_fields": trainer.args.to_dict(), "dataset": trainer.train_dataset, "rows": len(trainer.train_dataset),
            "config_pad": trainer.model.config.pad_token_id, "embeddings": tuple(trainer.model.get_input_embeddings().weight.shape),
            "eos_labels": int((batch["labels"] == EOS).sum())}


def assert_unchanged(trainer, before: dict) -> None:
    after = snapshot(trainer)
    for key, value in before.items():
        if key in ("tokenizer", "collator", "collator_tokenizer", "args", "dataset"):
            assert after[key] is value, key  # the very objects, not copies
        else:
            assert after[key] == value, key


def test_distinct_pad_token_is_verified_by_a_re_audit_and_the_users_objects_stay_as_they_were(tmp_path):
    trainer, tok = pad_is_eos_trainer(tmp_path)
    before = snapshot(trainer)
    assert before["eos_labels"] == 0 and before["pad"][1] == EOS  # the collator masks every EOS label

    result = nbguard.audit(trainer=trainer, verify=True)
    v = verdict(result, "distinct-pad-token")
    assert v.verdict == VERIFIED, v.reason
    assert v.reason.startswith(REAUDITED) and "eos-never-supervised no longer fires" in v.reason
    assert "no training step ran" in v.reason and v.step is None  # a re-audit, never a healthy step
    assert v.reaudit["rules"] == ["eos-never-supervised"] and v.reaudit["still_fires"] == {}
    assert v.reaudit["batches"]["batch_source"] == "trainer" and v.reaudit["batches"]["batches_seen"] > 0
    assert v.changes["tokenizer.pad_token"] == "'</s>' -> '<unk>'"  # on the shadow's tokenizer
    assert result.finding("eos-never-supervised").evidence["verdicts"] == {"distinct-pad-token": VERIFIED}

    assert_unchanged(trainer, before)  # isolation: pad id, collator, args, rows, config, embeddings
    assert tok.pad_token_id == EOS and trainer.model.config.pad_token_id == EOS
    assert "eos-never-supervised" in rules(nbguard.audit(trainer=trainer))  # the user's trainer still has it

    # the views say it was a re-audit: the story names no failing step
    text = str(result)
    assert "verified by a re-audit of the trainer as built (no step)" in text
    assert "distinct-pad-token (Use a pad token distinct from EOS): verified on the failing step" not in text
    doc = result.verification.to_document()
    assert doc["verification"]["verdicts"][0]["reaudit"]["rules"] == ["eos-never-supervised"]

    # and what the re-audit predicted holds when the user applies the fix to the trainer itself
    nbguard.fixes.apply("distinct-pad-token", trainer=trainer)
    assert "eos-never-supervised" not in rules(nbguard.audit(trainer=trainer))


def labelled_rows(rows: int = 8, length: int = 12) -> list[dict]:
    """Rows tokenized and labelled before the trainer, with pad == EOS: padded with EOS, and every label equal to
    the pad id masked, so each row's real EOS (attention 1) was masked too, in the data itself."""
    out = []
    for row in ragged_examples(rows, max_len=length - 2):
        ids = row["input_ids"]
        pad = length - len(ids)
        out.append({"input_ids": ids + [EOS] * pad, "attention_mask": [1] * len(ids) + [0] * pad,
                    "labels": [-100 if t == EOS else t for t in ids] + [-100] * pad})
    return out


def test_a_fix_the_data_already_outran_is_not_enough_and_never_recommended(tmp_path):
    """distinct-pad-token changes the tokenizer, but these rows were labelled before it: the trainer as built
    still never supervises EOS. The re-audit says "not enough" with the rule's own words."""
    from transformers import Trainer, default_data_collator

    tok = word_tokenizer(pad="eos")
    trainer = Trainer(model=tiny_llama(), args=make_args(tmp_path), train_dataset=ListDataset(labelled_rows()),
                      data_collator=default_data_collator, processing_class=tok)
    before = snapshot(trainer)
    result = nbguard.audit(trainer=trainer, verify=True)
    assert result.finding("eos-never-supervised").fixes == ["distinct-pad-token"]
    v = verdict(result, "distinct-pad-token")
    assert v.verdict == NOT_ENOUGH, v.reason
    assert v.reason.startswith(f"{REAUDITED}: eos-never-supervised still fires: no label is the end-of-sequence token")
    assert v.reaudit["still_fires"] == {"eos-never-supervised": [result.finding("eos-never-supervised").title]}
    assert v.changes["tokenizer.pad_token"] == "'</s>' -> '<unk>'"  # it did change the (shadow's) tokenizer
    assert_unchanged(trainer, before)
    # never the recommended fix: the card leaves its cell folded, the story says none was verified
    assert '<details open><summary>fix <code>distinct-pad-token</code>' not in html(result)
    assert "<summary>fix <code>distinct-pad-token</code>" in html(result)
    assert "Fix: none verified by a re-audit of the trainer as built (no step) (1 fix tried: distinct-pad-token " \
           "not enough)" in str(result)


def test_a_fix_that_would_resize_the_embeddings_is_not_checked_and_the_model_is_untouched(tmp_path):
    tok = word_tokenizer(pad="eos", unk=False)  # no unk: the fix adds <|pad|> and resizes the embeddings
    trainer = lm_trainer(tiny_llama(), make_args(tmp_path), ragged_examples(16), tokenizer=tok)
    result = nbguard.audit(trainer=trainer, verify=True)
    v = verdict(result, "distinct-pad-token")
    assert v.verdict == NOT_CHECKED and "resize the model's embeddings" in v.reason
    assert trainer.model.get_input_embeddings().weight.shape[0] == TINY_VOCAB and len(tok) == TINY_VOCAB
    assert tok.pad_token_id == EOS and "<|pad|>" not in tok.get_vocab()


# ---- (2) and (3) TRL's SFTTrainer: its prepared dataset ---------------------------------------------------------------
def sft_trainer(tok, rows: list[dict], max_length: int = 64):
    args = trl.SFTConfig(output_dir=tempfile.mkdtemp(), use_cpu=True, report_to=[], max_steps=1,
                         per_device_train_batch_size=2, save_strategy="no", disable_tqdm=True, max_length=max_length)
    return trl.SFTTrainer(model=tiny_llama(), args=args, processing_class=tok, train_dataset=datasets.Dataset.from_list(rows))


def test_double_bos_on_the_trainer_as_built_drop_is_verified_and_the_tokenizer_switch_is_not_enough():
    """The template wrote <s> and the tokenizer added another: TRL prepared rows that start with two. Dropping the
    first from TRL's prepared rows clears the re-audit; stopping the tokenizer does not (the rows exist already)."""
    tok = chat_tokenizer(WITH_GENERATION, add_bos=True)
    trainer = sft_trainer(tok, [{"text": tok.apply_chat_template(conversation(seed=i), tokenize=False)}
                                for i in range(4)])
    dataset, collator, args_fields = trainer.train_dataset, trainer.data_collator, trainer.args.to_dict()
    pad_id = collator.pad_token_id

    result = nbguard.audit(trainer=trainer, verify=True)
    assert result.finding("double-bos").fixes == ["drop-doubled-bos", "tokenizer-no-bos"]
    drop, switch = verdict(result, "drop-doubled-bos"), verdict(result, "tokenizer-no-bos")
    assert drop.verdict == VERIFIED and "double-bos no longer fires" in drop.reason, drop.reason
    assert drop.changes == {"trainer.train_dataset": "4 of 4 rows start with one BOS instead of two"}
    assert switch.verdict == NOT_ENOUGH and "double-bos still fires: 4 of 4 sampled rows start with two BOS" in switch.reason
    assert switch.changes["tokenizer.add_bos_token"].startswith("True -> False")
    # ranked: the verified fix first, and only it is the recommended one (its cell folded, a click away)
    assert [v.fix for v in result.verification.verdicts] == ["drop-doubled-bos", "tokenizer-no-bos"]
    page = html(result)
    assert '<details><summary>recommended fix <code>drop-doubled-bos</code>' in page
    assert 'recommended fix <code>tokenizer-no-bos</code>' not in page and "<details open>" not in page

    # isolation: TRL's prepared rows, the tokenizer, the collator and the args are the user's, unchanged
    assert trainer.train_dataset is dataset and len(dataset) == 4
    assert all(list(r[:2]) == [BOS_ID, BOS_ID] for r in dataset["input_ids"])
    assert tok.add_bos_token is True and tok("w9")["input_ids"] == [BOS_ID, 9]
    assert trainer.processing_class is tok and trainer.data_collator is collator and collator.pad_token_id == pad_id
    assert trainer.args.to_dict() == args_fields


def words(n: int, seed: int) -> str:
    return " ".join(f"w{3 + (seed * 7 + j * 3) % 120}" for j in range(n))


def test_drop_truncated_rows_is_verified_through_trls_prepared_dataset():
    long_rows = {3: 30, 17: 22}  # past max_length=16 with TRL's appended EOS: cut inside the answer
    texts = [words(long_rows.get(i, 3 + i % 7), i) for i in range(24)]
    trainer = sft_trainer(word_tokenizer(pad="unk"), [{"text": t} for t in texts], max_length=16)
    dataset = trainer.train_dataset
    result = nbguard.audit(trainer=trainer, verify=True)
    v = verdict(result, "drop-truncated-rows")
    assert v.verdict == VERIFIED and "answers-cut-by-max-length no longer fires" in v.reason, v.reason
    assert "24 -> 22 rows" in v.changes["trainer.train_dataset"]
    assert trainer.train_dataset is dataset and len(trainer.train_dataset) == 24  # the user's rows all there
    assert "answers-cut-by-max-length" in rules(nbguard.audit(trainer=trainer))


def test_a_fix_that_empties_the_dataloader_is_not_enough(tmp_path, monkeypatch):
    """A re-audit whose shadow has no batch left cannot call the finding gone: a batch rule that sees nothing
    is silent. The fix here drops every row (its apply replaced to do so, on the shadow it is given)."""
    import dataclasses

    from nbguard.fixes.registry import FIXES

    def drop_all(target, **_):
        target.trainer.train_dataset = ListDataset([])
        return {"trainer.train_dataset": "16 -> 0 rows"}

    monkeypatch.setitem(FIXES, "distinct-pad-token", dataclasses.replace(FIXES["distinct-pad-token"], apply=drop_all))
    trainer, _ = pad_is_eos_trainer(tmp_path)
    v = verdict(nbguard.audit(trainer=trainer, verify=True), "distinct-pad-token")
    assert v.verdict == NOT_ENOUGH and "gives no batch under it" in v.reason, v.reason
    assert len(trainer.train_dataset) == 16


def test_model_fixes_are_not_re_audited(tmp_path):
    """dropout-train-mode changes modules: the verdict says why it was not checked, and the model stays as it was."""
    model = tiny_llama()
    trainer = lm_trainer(model, make_args(tmp_path), ragged_examples(16), tokenizer=word_tokenizer(pad="unk"))
    dropout = torch.nn.Dropout(0.1)
    model.model.layers[0].add_module("extra_dropout", dropout)  # a dropout layer a wrapper left in eval
    model.train()
    dropout.eval()
    result = nbguard.audit(trainer=trainer, verify=True)
    assert result.finding("dropout-off-in-training").fixes == ["dropout-train-mode"]
    v = verdict(result, "dropout-train-mode")
    assert v.verdict == NOT_CHECKED and v.reason == MODEL_REASON and v.reaudit is None
    assert dropout.training is False and model.training is True


def test_a_finding_only_the_given_batch_shows_is_not_checked_on_the_trainer(tmp_path):
    """The audit read batch= (a language-modelling collator's, EOS labels masked), but the trainer's own collator
    keeps EOS labels: a re-audit of the trainer cannot show what the fix changes, and says so."""
    from transformers import DataCollatorForLanguageModeling

    tok = word_tokenizer(pad="eos")
    lm = DataCollatorForLanguageModeling(tok, mlm=False)

    def keeps_eos(features):
        batch = lm(features)
        batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        return batch

    trainer = lm_trainer(tiny_llama(), make_args(tmp_path), ragged_examples(16), collator=keeps_eos, tokenizer=tok)
    given = lm(ragged_examples(8, seed=1))
    result = nbguard.audit(trainer=trainer, batch=given, verify=True)
    assert result.finding("eos-never-supervised").fixes == ["distinct-pad-token"]
    v = verdict(result, "distinct-pad-token")
    assert v.verdict == NOT_CHECKED and "does not fire on the trainer as built" in v.reason, v.reason

    # the same given batch from the trainer's own kind of collator: the trainer shows it too, and the re-audit runs
    trainer = lm_trainer(tiny_llama(), make_args(tmp_path / "lm"), ragged_examples(16), tokenizer=tok)
    assert verdict(nbguard.audit(trainer=trainer, batch=given, verify=True), "distinct-pad-token").verdict == VERIFIED


# ---- TRL's RewardTrainer: a collator that took the pad id when the trainer was built ---------------------------------
def test_reward_trainer_pad_fix_is_verified_and_a_tokenizer_only_variant_is_not_enough(tmp_path, monkeypatch):
    """TRL pads with EOS and its DataCollatorForPreference keeps the pad id it was built with. distinct-pad-token
    also updates that collator: verified by the re-audit. The same fix without the collator (tokenizer and config
    only, as a notebook would first write it) leaves the trainer as built padding with EOS: not enough."""
    import dataclasses

    from test_fix_on_trainer_as_built import POOLS, padded_with, reward_trainer

    from nbguard.fixes.data_fixes import _distinct_pad
    from nbguard.fixes.registry import FIXES, Target

    trainer, tok = reward_trainer(tmp_path)
    before = (tok.pad_token_id, trainer.data_collator.pad_token_id, trainer.model.config.pad_token_id)
    assert before == (EOS, EOS, EOS) and padded_with(trainer) == {EOS}
    v = verdict(nbguard.audit(trainer=trainer, verify=True), "distinct-pad-token")
    assert v.verdict == VERIFIED and f"{POOLS} no longer fires" in v.reason, v.reason
    assert v.changes["trainer.data_collator.pad_token_id"] == f"{EOS} -> {tok.unk_token_id}"
    assert (tok.pad_token_id, trainer.data_collator.pad_token_id, trainer.model.config.pad_token_id) == before
    assert padded_with(trainer) == {EOS}

    def tokenizer_and_config_only(target, **options):
        return _distinct_pad(Target(model=target.model, tokenizer=target.tokenizer), **options)

    monkeypatch.setitem(FIXES, "distinct-pad-token",
                        dataclasses.replace(FIXES["distinct-pad-token"], apply=tokenizer_and_config_only))
    v = verdict(nbguard.audit(trainer=trainer, verify=True), "distinct-pad-token")
    assert v.verdict == NOT_ENOUGH and f"{POOLS} still fires" in v.reason, v.reason
    assert "trainer.data_collator.pad_token_id" not in v.changes and "tokenizer.pad_token" in v.changes
    assert (tok.pad_token_id, trainer.data_collator.pad_token_id, trainer.model.config.pad_token_id) == before


def test_step_verdicts_and_re_audit_verdicts_share_one_ranked_verification(tmp_path):
    """A bf16 model (upcast-trainable-fp32 has a step recipe) and a pad == EOS tokenizer (distinct-pad-token has
    none): one audit, both verdicts, the re-audited one ranked first and the step ran for the other only."""
    tok = word_tokenizer(pad="eos")
    trainer = lm_trainer(tiny_llama(dtype=torch.bfloat16), make_args(tmp_path), ragged_examples(16), tokenizer=tok)
    result = nbguard.audit(trainer=trainer, verify=True)
    assert {"distinct-pad-token", "upcast-trainable-fp32"} <= set(result.fix_ids)
    pad, upcast = verdict(result, "distinct-pad-token"), verdict(result, "upcast-trainable-fp32")
    assert pad.verdict == VERIFIED and pad.reaudit is not None and pad.step is None
    assert upcast.reaudit is None and result.verification.baseline is not None  # a real shadow step ran for it
    assert result.verification.verdicts[0].fix == "distinct-pad-token"
    assert [v.rank for v in result.verification.verdicts] == sorted(v.rank for v in result.verification.verdicts)
    assert any("re-audited on a shadow of the trainer" in note for note in result.verification.notes)
    assert all(p.dtype == torch.bfloat16 for p in trainer.model.parameters()) and tok.pad_token_id == EOS


def test_verify_a_finding_re_audits_its_data_fix_on_the_trainer(tmp_path):
    """nbguard.verify(finding, trainer=...) takes the same path as the audit: the finding's rule first on the
    trainer itself, then on the fixed shadow; the verification is on the session's timeline."""
    from nbguard.session import SESSION

    trainer, tok = pad_is_eos_trainer(tmp_path)
    finding = nbguard.audit(trainer=trainer).finding("eos-never-supervised")
    verification = nbguard.verify(finding, trainer=trainer)
    v = verification.verdict("distinct-pad-token")
    assert v.verdict == VERIFIED and v.reaudit["rules"] == ["eos-never-supervised"], v.reason
    assert verification.step_level is False and verification.baseline is None  # no step ran
    assert SESSION.entries("verification") and tok.pad_token_id == EOS

    healthy = lm_trainer(tiny_llama(), make_args(tmp_path / "ok"), ragged_examples(16),
                         tokenizer=word_tokenizer(pad="unk"))
    v = nbguard.verify(finding, trainer=healthy).verdict("distinct-pad-token")  # a finding this trainer never raised
    assert v.verdict == NOT_CHECKED and "does not fire on the trainer as built" in v.reason, v.reason


# ---- TRL's GRPOTrainer: a rule that raises one finding per reward function --------------------------------------------
def test_finite_rewards_is_judged_on_its_own_function_and_the_users_list_is_untouched(tmp_path):
    """rl-reward-function-broken raises one finding per broken function: finite-rewards clears the -inf one (the
    one that offers it) while the function returning the wrong count still fires. Verified, and the trainer's
    reward_funcs list still holds the user's own functions."""
    from rl_helpers import grpo_trainer, length_reward, log_match_reward

    def wrong_length(completions, **kwargs):
        return [1.0]

    funcs = [length_reward, wrong_length, log_match_reward]
    trainer = grpo_trainer(tmp_path, reward_funcs=list(funcs))
    held = trainer.reward_funcs
    result = nbguard.audit(trainer=trainer, verify=True)
    broken = [f for f in result.findings if f.rule == "rl-reward-function-broken"]
    assert sorted(f.evidence["reward_function"] for f in broken) == ["log_match_reward", "wrong_length"]
    v = verdict(result, "finite-rewards")
    assert v.verdict == VERIFIED and "rl-reward-function-broken no longer fires" in v.reason, v.reason
    assert v.changes["reward_funcs[2]"] == "log_match_reward: non-finite rewards -> None"  # on the shadow's list
    assert trainer.reward_funcs is held and trainer.reward_funcs == funcs  # the very functions, unwrapped
    assert not getattr(trainer.reward_funcs[2], "__nbguard_finite__", False)


# ---- collator wrappers and a trainer flag: verified on the shadow, the user's trainer as it was ------------------------
def shifted_labels_trainer(tmp_path):
    from test_rules_data import _trl_collator, shifted_rows

    return lm_trainer(tiny_llama(), make_args(tmp_path), shifted_rows(), collator=_trl_collator())


def packed_with_mask_trainer(tmp_path):
    from test_rules_packing import FlattenWithMask, packing_trainer

    return packing_trainer(tmp_path, FlattenWithMask())


def mean_loss_trainer(tmp_path):
    from test_rules_data_accumulation import MeanLossTrainer, build

    return build(tmp_path, "broken", MeanLossTrainer)


@pytest.mark.parametrize("build, rule, fix_id", [
    (shifted_labels_trainer, "labels-shifted-twice", "unshift-labels"),
    (packed_with_mask_trainer, "packed-samples-attend-across", "drop-mask-for-packing"),
    (mean_loss_trainer, "accumulation-loss-scale", "scale-loss-for-accumulation"),
])
def test_wrapper_and_flag_fixes_are_verified_on_the_shadow_only(tmp_path, build, rule, fix_id):
    trainer = build(tmp_path)
    collator, flags = trainer.data_collator, {k: v for k, v in vars(trainer).items() if isinstance(v, bool)}
    result = nbguard.audit(trainer=trainer, verify=True)
    v = verdict(result, fix_id)
    assert v.verdict == VERIFIED and f"{rule} no longer fires" in v.reason and v.changes, v.reason
    assert trainer.data_collator is collator  # the user's collator, not the shadow's wrapper
    assert {k: v for k, v in vars(trainer).items() if isinstance(v, bool)} == flags
    assert rule in rules(nbguard.audit(trainer=trainer))


def test_a_step_verdict_for_a_tokenizer_fix_is_the_audits_own_cell_on_a_trainer(tmp_path):
    """pad-right-for-training has a step recipe: its verdict's cell names the trainer's processing_class, the
    cell the finding shows, so the finding's fix row carries the verdict (keyed by the exact cell)."""
    trainer = lm_trainer(tiny_llama(), make_args(tmp_path), ragged_examples(16),
                         tokenizer=word_tokenizer(pad="unk", padding_side="left"))
    result = nbguard.audit(trainer=trainer, verify=True)
    v = verdict(result, "pad-right-for-training")
    assert v.reaudit is None and "trainer.processing_class.padding_side" in v.code
    assert v.code == result.to_document()["fix_cells"]["pad-right-for-training"]["code"]
