"""Data and label failure modes (issue 13 items 1-3 and 5): each rule on batches a real Trainer builds with
a real tokenizer and collator, the mechanism on a tiny real model, and each fix applied and run as its cell."""
from __future__ import annotations

import pytest
import torch
from audit_helpers import make_args
from data_helpers import EOS, lm_trainer, ragged_examples, word_tokenizer
from notebook_helpers import run, shell  # noqa: F401  (the shell fixture)
from transformers import DataCollatorForLanguageModeling

import nbguard
import nbguard.fixes as fixes
from nbguard.auditor.rules.padding import masked_query_rows
from nbguard.auditor.sampling import sample_trainer_batches
from nbguard.testing import tiny_gemma3, tiny_llama, tiny_qwen2


def audit(*a, **kw):
    kw.setdefault("hardware", "a100")
    return nbguard.audit(*a, **kw)


def run_cell(cell: str, **namespace):
    exec(compile(cell, "<nbguard fix cell>", "exec"), namespace)
    return namespace


def collate(tokenizer, rows=8, seed=0):
    return DataCollatorForLanguageModeling(tokenizer, mlm=False)(ragged_examples(rows, seed=seed))


def test_rules_and_fixes_are_registered_with_what_they_need():
    from nbguard.auditor import RULES

    severities = {r: RULES[r].severity.value for r in ("left-padding-training", "eos-never-supervised",
                                                       "labels-shifted-twice", "accumulation-loss-scale",
                                                       "no-supervised-tokens", "batch-sampling-error")}
    assert severities == {"left-padding-training": "warning", "eos-never-supervised": "warning",
                          "labels-shifted-twice": "error", "accumulation-loss-scale": "warning",
                          "no-supervised-tokens": "error", "batch-sampling-error": "warning"}
    needs = {f: fixes.get(f).needs for f in ("pad-right-for-training", "distinct-pad-token", "unshift-labels",
                                             "scale-loss-for-accumulation")}
    assert needs == {"pad-right-for-training": "tokenizer", "distinct-pad-token": "tokenizer",
                     "unshift-labels": "trainer", "scale-loss-for-accumulation": "trainer"}
    with pytest.raises(ValueError, match="needs trainer="):
        fixes.apply("scale-loss-for-accumulation", model=tiny_llama())


def test_tokenizer_is_a_name_for_every_fix_that_reads_one():
    tok = word_tokenizer(pad="unk")
    tok.add_tokens(["w128", "w129"])
    model = tiny_llama()
    result = fixes.apply("resize-token-embeddings", model=model, tokenizer=tok)  # the object, for apply
    assert model.get_input_embeddings().weight.shape[0] == 130 and "len(tokenizer)" in result.code
    assert "len(my_tok)" in fixes.code("resize-token-embeddings", model="m", tokenizer="my_tok")  # a name, for code
    assert "len(tr.processing_class)" in fixes.code("resize-token-embeddings", trainer="tr")


# ---- sampling from the trainer's own dataloader -----------------------------------------------
class SpyCollator:
    """Records the first input id of every row it collates: the order the sampler handed examples out."""

    def __init__(self, inner):
        self.inner, self.seen = inner, []

    def __call__(self, features):
        batch = self.inner(features)
        self.seen.append(batch["input_ids"][:, 0].tolist())
        return batch


def _spied_trainer(tmp_path, name):
    tok = word_tokenizer(pad="unk")
    spy = SpyCollator(DataCollatorForLanguageModeling(tok, mlm=False))
    args = make_args(tmp_path / name, per_device_train_batch_size=2, max_steps=4, seed=7)
    return lm_trainer(tiny_llama(), args, ragged_examples(16), collator=spy, tokenizer=tok), spy


def test_sampling_keeps_the_data_order_rng_and_accelerator_state(tmp_path):
    # The audit collates from a loader of its own (train() builds a fresh one) and puts every global RNG back
    # (dropout and any sampler without its own generator draw from it).
    audited, spy = _spied_trainer(tmp_path, "a")
    before = torch.get_rng_state()
    loaders = list(audited.accelerator._dataloaders)
    state = audited.accelerator.gradient_state  # shared by every Accelerator in the process
    references = list(state.dataloader_references)
    result = audit(trainer=audited)
    assert result.finding("no-supervised-tokens") is None
    sampled = len(spy.seen)
    assert sampled >= 8  # the audit really collated batches from the trainer's dataloader
    assert torch.equal(torch.get_rng_state(), before)
    assert audited.accelerator._dataloaders == loaders
    assert state.dataloader_references == references  # no half-read loader left "active" for training
    audited.train()
    plain, plain_spy = _spied_trainer(tmp_path, "b")
    plain.train()
    assert spy.seen[sampled:] == plain_spy.seen  # training saw the same examples in the same order


def test_sampling_refuses_iterable_datasets_and_bad_counts(tmp_path):
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield from ragged_examples(4)

    tok = word_tokenizer(pad="unk")
    trainer = lm_trainer(tiny_llama(), make_args(tmp_path), [], tokenizer=tok)
    trainer.train_dataset = Stream()
    sample = sample_trainer_batches(trainer)
    assert sample.batches == [] and "IterableDataset" in sample.note
    with pytest.raises(ValueError, match="count must be a positive int"):
        sample_trainer_batches(trainer, 0)


def test_a_collator_that_raises_is_one_finding_not_a_rule_error_per_rule(tmp_path):
    def broken(features):
        raise KeyError("response_template")

    trainer = lm_trainer(tiny_llama(), make_args(tmp_path), ragged_examples(8), collator=broken)
    result = audit(trainer=trainer)
    f = result.finding("batch-sampling-error")
    assert f.severity == "warning" and "KeyError" in f.evidence["exception"]
    assert "rule-error" not in result
    with pytest.raises(KeyError, match="response_template"):
        trainer.train()  # what the finding predicts
    fine = lm_trainer(tiny_llama(), make_args(tmp_path), ragged_examples(8), tokenizer=word_tokenizer(pad="unk"))
    assert "batch-sampling-error" not in audit(trainer=fine)


# ---- item 3: rows with no supervised token --------------------------------------------------
def completion_only_rows(rows: int = 16, empty_every: int = 4, max_length: int = 12):
    """Prompt tokens labelled -100, completion tokens supervised, then truncated to max_length the way a
    completion-only pipeline does: every ``empty_every``-th prompt is too long and its completion is cut away."""
    gen = torch.Generator().manual_seed(3)
    out = []
    for i in range(rows):
        prompt_len = max_length + 2 if (i + 1) % empty_every == 0 else 5
        prompt = torch.randint(3, 128, (prompt_len,), generator=gen).tolist()
        completion = torch.randint(3, 128, (4,), generator=gen).tolist() + [EOS]
        ids = (prompt + completion)[:max_length]
        labels = ([-100] * prompt_len + completion)[:max_length]
        out.append({"input_ids": ids, "labels": labels})
    return out


def _trl_collator():
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling as TrlCollator

    return TrlCollator(pad_token_id=0)


def test_empty_rows_share_from_the_trainers_batches(tmp_path):
    model = tiny_llama()
    trainer = lm_trainer(model, make_args(tmp_path, per_device_train_batch_size=4), completion_only_rows(),
                         collator=_trl_collator())
    f = audit(trainer=trainer).finding("no-supervised-tokens")
    ev = f.evidence
    assert ev["batch_source"] == "trainer" and ev["batches_seen"] == 4 and ev["rows_seen"] == 16
    assert ev["rows"]["count"] == 4 and ev["empty_share"] == pytest.approx(0.25)
    assert f.severity == "warning" and "25%" in f.title
    # The mechanism: a micro-batch made of such rows alone has a 0/0 loss.
    empty_rows = [r for r in completion_only_rows() if all(v == -100 for v in r["labels"][1:])]
    batch = _trl_collator()(empty_rows[:2])
    assert torch.isnan(model(**batch).loss)


def test_no_empty_rows_when_every_completion_survives(tmp_path):
    trainer = lm_trainer(tiny_llama(), make_args(tmp_path), completion_only_rows(empty_every=10**6),
                         collator=_trl_collator())
    assert "no-supervised-tokens" not in audit(trainer=trainer)


# ---- item 1: left padding -------------------------------------------------------------------
def test_left_padding_found_in_the_models_own_4d_mask(tmp_path):
    tok = word_tokenizer(pad="unk", padding_side="left")
    trainer = lm_trainer(tiny_llama(), make_args(tmp_path), ragged_examples(16), tokenizer=tok)
    result = audit(trainer=trainer)
    f = result.finding("left-padding-training")
    assert f is not None and f.fixes == ["pad-right-for-training"]
    assert f.evidence["padding_side"] == "left" and f.evidence["batch_source"] == "trainer"
    assert f.evidence["mask_source"] == "transformers.masking_utils.create_causal_mask"
    assert f.evidence["masked_query_positions"] > 0 and f.evidence["supervised_from_masked_rows"] > 0
    assert "fully-masked-rows" not in result  # no 2-D row is all zeros: only the 4-D mask shows it


def test_right_padding_and_unpadded_kernels_are_fine(tmp_path):
    tok = word_tokenizer(pad="unk", padding_side="right")
    trainer = lm_trainer(tiny_llama(), make_args(tmp_path), ragged_examples(16), tokenizer=tok)
    assert "left-padding-training" not in audit(trainer=trainer)
    left = collate(word_tokenizer(pad="unk", padding_side="left"))
    model = tiny_llama()
    assert "left-padding-training" in audit(model, batch=left)
    model.config._attn_implementation = "flash_attention_2"  # varlen kernels drop the padding: no 4-D mask
    assert "left-padding-training" not in audit(model, batch=left)


@pytest.mark.parametrize("build", [tiny_gemma3, tiny_qwen2], ids=["gemma3", "qwen2"])
def test_left_padding_on_other_architectures(build):
    model = build()
    f = audit(model, batch=collate(word_tokenizer(pad="unk", padding_side="left"))).finding("left-padding-training")
    assert f is not None and f.evidence["batch_source"] == "batch" and f.evidence["supervised_from_masked_rows"] > 0
    assert "left-padding-training" not in audit(model, batch=collate(word_tokenizer(pad="unk")))


def test_masked_query_rows_are_the_causal_times_padding_mask():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    rows, source = masked_query_rows(tiny_llama().config, mask)
    assert source == "transformers.masking_utils.create_causal_mask"
    assert rows.tolist() == [[True, True, False, False, False], [False] * 5, [False] * 5]
    assert torch.equal(rows, mask.cumsum(dim=-1) == 0)  # the derived product used where masking_utils is missing


def test_left_padding_mechanism_garbage_from_a_row_that_sees_nothing():
    """On CPU (torch 2.13) neither kernel gives NaN, but the first real token's prediction is made from a query
    row with every key masked: eager attention spreads it over every key (future tokens leak in) and sdpa zeroes
    it, so the loss depends on the attention implementation. Right padding gives the same loss in both."""
    left = collate(word_tokenizer(pad="unk", padding_side="left"))
    right = collate(word_tokenizer(pad="unk", padding_side="right"))
    eager, sdpa = tiny_llama(attn_implementation="eager"), tiny_llama(attn_implementation="sdpa")
    with torch.no_grad():
        assert torch.allclose(eager(**right).loss, sdpa(**right).loss, atol=1e-5)
        assert not torch.allclose(eager(**left).loss, sdpa(**left).loss, atol=1e-3)
        row = int((left["attention_mask"] == 0).any(dim=1).nonzero()[0])
        last_pad = int((left["attention_mask"][row] == 0).nonzero().max())
        before = eager(**left).logits[row, last_pad]
        future = {k: v.clone() for k, v in left.items()}
        future["input_ids"][row, -2] = (future["input_ids"][row, -2] + 1) % 120 + 3  # change a later token
        after = eager(**future).logits[row, last_pad]
        assert not torch.allclose(before, after)  # a causal LM's position saw the future: garbage, not causal
        assert torch.isfinite(before).all()


def test_pad_right_fix_apply_and_cell(tmp_path):
    tok = word_tokenizer(pad="unk", padding_side="left")
    trainer = lm_trainer(tiny_llama(), make_args(tmp_path), ragged_examples(16), tokenizer=tok)
    first = fixes.apply("pad-right-for-training", trainer=trainer)
    assert first.changed == {"tokenizer.padding_side": "left -> right"} and tok.padding_side == "right"
    assert fixes.apply("pad-right-for-training", trainer=trainer).changed == {}
    assert "left-padding-training" not in audit(trainer=trainer)
    assert "trainer.processing_class.padding_side" in first.code

    other = word_tokenizer(pad="unk", padding_side="left")
    cell = fixes.code("pad-right-for-training", tokenizer="my_tok")
    assert "my_tok.padding_side" in cell and "nbguard" not in cell
    run_cell(cell, my_tok=other)
    assert other.padding_side == "right"
    assert "left-padding-training" not in audit(tiny_llama(), batch=collate(other))
    with pytest.raises(ValueError, match="needs tokenizer="):
        fixes.apply("pad-right-for-training", model=tiny_llama())


# ---- item 2: pad == eos ---------------------------------------------------------------------
def test_eos_never_supervised_when_pad_is_eos(tmp_path):
    tok = word_tokenizer(pad="eos")
    trainer = lm_trainer(tiny_llama(), make_args(tmp_path), ragged_examples(16), tokenizer=tok)
    f = audit(trainer=trainer).finding("eos-never-supervised")
    assert f is not None and f.fixes == ["distinct-pad-token"]
    assert f.evidence["pad_is_eos"] and f.evidence["eos_token_id"] == [EOS] and f.evidence["eos_read_but_unlabelled"] > 0
    # The mechanism in the real collator: every example's real EOS (attention_mask 1) gets label -100.
    batch = collate(tok)
    real_eos = (batch["input_ids"] == EOS) & (batch["attention_mask"] == 1)
    assert real_eos.sum() == 8 and (batch["labels"][real_eos] == -100).all()


def test_eos_supervised_with_a_distinct_pad_or_no_eos_at_all(tmp_path):
    trainer = lm_trainer(tiny_llama(), make_args(tmp_path), ragged_examples(16), tokenizer=word_tokenizer(pad="unk"))
    assert "eos-never-supervised" not in audit(trainer=trainer)
    no_eos = collate(word_tokenizer(pad="unk"))
    no_eos["labels"][no_eos["labels"] == EOS] = 7
    no_eos["input_ids"][no_eos["input_ids"] == EOS] = 7
    assert "eos-never-supervised" not in audit(tiny_llama(), batch=no_eos)  # nothing says the data meant to stop


def test_distinct_pad_fix_uses_unk_then_the_collator_keeps_eos(tmp_path):
    tok = word_tokenizer(pad="eos")
    model = tiny_llama()
    trainer = lm_trainer(model, make_args(tmp_path), ragged_examples(16), tokenizer=tok)
    first = fixes.apply("distinct-pad-token", trainer=trainer)
    assert tok.pad_token == "<unk>" and first.changed["tokenizer.pad_token"] == "'</s>' -> '<unk>'"
    assert model.config.pad_token_id == tok.pad_token_id
    assert fixes.apply("distinct-pad-token", trainer=trainer).changed == {}
    assert "eos-never-supervised" not in audit(trainer=trainer)
    batch = sample_trainer_batches(trainer).batches[0]
    assert (batch["labels"] == EOS).sum() == batch["input_ids"].shape[0]  # each row's EOS is a target now


def test_distinct_pad_cell_adds_a_token_and_resizes_when_there_is_no_unk():
    tok = word_tokenizer(pad="eos", unk=False)
    model = tiny_llama()
    cell = fixes.code("distinct-pad-token", tokenizer="tok", model="lm")
    assert "nbguard" not in cell
    run_cell(cell, tok=tok, lm=model)
    assert tok.pad_token == "<|pad|>" and tok.pad_token_id == 128
    assert model.get_input_embeddings().weight.shape[0] == 129 and model.config.pad_token_id == 128
    batch = collate(tok)
    assert (batch["labels"] == EOS).sum() == 8
    assert "eos-never-supervised" not in audit(model, batch=batch)
    # apply on a second tokenizer without unk needs the model, and says so
    with pytest.raises(ValueError, match="must resize the embeddings"):
        fixes.apply("distinct-pad-token", tokenizer=word_tokenizer(pad="eos", unk=False))


def test_with_pad_equal_to_eos_the_model_never_learns_to_stop(tmp_path):
    """Every example is "w3 ... w9 </s>" (right-padded to different lengths); after the same short training the
    model predicts EOS after w9 only when the collator kept the EOS labels."""
    rows = [{"input_ids": list(range(3, 10)) + [EOS]} for _ in range(6)] + [{"input_ids": [3, 4, 5, EOS]}] * 2

    def p_eos_after_w9(pad: str) -> float:
        tok = word_tokenizer(pad=pad)
        model = tiny_llama()
        args = make_args(tmp_path / pad, per_device_train_batch_size=8, max_steps=20, learning_rate=1e-2)
        lm_trainer(model, args, rows, tokenizer=tok).train()
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([list(range(3, 10))])).logits[0, -1]
        return logits.softmax(-1)[EOS].item()

    assert p_eos_after_w9("eos") < 0.05
    assert p_eos_after_w9("unk") > 0.5


# ---- item 5: labels shifted twice ----------------------------------------------------------------
def shifted_rows(rows: int = 16):
    """The user's preprocessing that shifts for next-token prediction itself: labels[t] = input_ids[t + 1]."""
    out = []
    for r in ragged_examples(rows):
        ids = r["input_ids"]
        out.append({"input_ids": ids, "labels": ids[1:] + [-100]})
    return out


def test_labels_shifted_twice_found_on_the_trainers_batches(tmp_path):
    trainer = lm_trainer(tiny_llama(), make_args(tmp_path), shifted_rows(), collator=_trl_collator())
    f = audit(trainer=trainer).finding("labels-shifted-twice")
    assert f is not None and f.severity == "error" and f.fixes == ["unshift-labels"]
    assert f.evidence["share_equal_to_next_input"] == 1.0 and f.evidence["share_equal_to_same_input"] < 0.1
    aligned = lm_trainer(tiny_llama(), make_args(tmp_path), ragged_examples(16), collator=_trl_collator())
    assert "labels-shifted-twice" not in audit(trainer=aligned)


def _cycle_rows(rows: int, shift: bool):
    """Sequences that follow a fixed successor table: next(t) = perm[t]. Easy to learn in a few steps."""
    gen = torch.Generator().manual_seed(0)
    perm = torch.randperm(125, generator=gen) + 3
    out = []
    for i in range(rows):
        ids = [3 + i % 125]
        for _ in range(11):
            ids.append(int(perm[ids[-1] - 3]))
        out.append({"input_ids": ids, "labels": ids[1:] + [-100] if shift else list(ids)})
    return out, perm


def test_labels_shifted_twice_teach_the_token_two_steps_ahead_and_the_fix_undoes_it(tmp_path):
    rows, perm = _cycle_rows(64, shift=True)

    def train(fix: bool):
        model = tiny_llama()
        args = make_args(tmp_path, per_device_train_batch_size=16, max_steps=60, learning_rate=1e-2, seed=0)
        trainer = lm_trainer(model, args, rows, collator=_trl_collator())
        if fix:
            assert fixes.apply("unshift-labels", trainer=trainer).changed
            assert fixes.apply("unshift-labels", trainer=trainer).changed == {}
            assert "labels-shifted-twice" not in audit(trainer=trainer)
        trainer.train()
        ids = torch.tensor([rows[5]["input_ids"]])
        with torch.no_grad():
            pred = model(input_ids=ids).logits.argmax(-1)[0, :-2]
        nxt = torch.tensor([int(perm[t - 3]) for t in ids[0, :-2]])
        two_ahead = torch.tensor([int(perm[int(perm[t - 3]) - 3]) for t in ids[0, :-2]])
        return (pred == nxt).float().mean().item(), (pred == two_ahead).float().mean().item()

    next_acc, two_acc = train(fix=False)
    assert two_acc > 0.8 and next_acc < 0.2  # it learned the token two steps ahead
    next_acc, two_acc = train(fix=True)
    assert next_acc > 0.8


def test_unshift_cell_wraps_the_collator_once(tmp_path):
    trainer = lm_trainer(tiny_llama(), make_args(tmp_path), shifted_rows(), collator=_trl_collator())
    cell = fixes.code("unshift-labels", trainer="my_trainer")
    assert "nbguard" not in cell
    run_cell(cell, my_trainer=trainer)
    run_cell(cell, my_trainer=trainer)
    assert not getattr(trainer.data_collator.collator, "unshifts_labels", False)  # wrapped exactly once
    batch = trainer.data_collator([{"input_ids": [5, 6, 7, 8], "labels": [6, 7, 8, -100]}])
    assert batch["labels"].tolist() == [[-100, 6, 7, 8]]
    assert "labels-shifted-twice" not in audit(trainer=trainer)
    assert fixes.apply("unshift-labels", trainer=trainer).changed == {}  # the cell's wrapper counts as applied
    with pytest.raises(ValueError, match="pass trainer="):
        fixes.code("unshift-labels", model="m")


def test_precision_check_cells_name_the_notebooks_tokenizer(tmp_path, shell):
    tok = word_tokenizer(pad="unk", padding_side="left")
    shell.user_ns.update(my_tok=tok, my_trainer=lm_trainer(tiny_llama(), make_args(tmp_path), ragged_examples(16),
                                                           tokenizer=tok))
    doc = run(shell, "%precision_check my_trainer").docs[0]
    assert "left-padding-training" in {f["rule"] for f in doc["findings"]}
    code = doc["fix_cells"]["pad-right-for-training"]["code"]
    assert 'my_tok.padding_side = "right"' in code
    run(shell, code)
    assert tok.padding_side == "right"
