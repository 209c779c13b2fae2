"""Fixes for the data and label failure modes: padding side, pad token, label alignment, loss scaling.

They act on the tokenizer (given as ``tokenizer=``, else the trainer's ``processing_class``) and on
the Trainer (its collator, its loss scaling); each cell says the same in plain transformers code.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from ..step.capture import supervised_rows
from ..step.plan import CapturedStep, NotCheckable, ShadowPlan
from . import drop_rows  # noqa: F401  (registers drop-rows: the rows a watch event named, by dataset index)
from .registry import Fix, Names, Target, register
from .setup_fixes import set_pad_token_id

PAD_TOKEN = "<|pad|>"  # added only when the tokenizer has no distinct special token to pad with
UNSHIFT_MARK = "unshifts_labels"  # set on the wrapping collator by apply and by the cell: never wrap twice


# ---- pad-right-for-training ------------------------------------------------------------------
def _pad_right(target: Target, **_: Any) -> dict:
    tok = target.tokenizer
    if tok.padding_side == "right":
        return {}
    old, tok.padding_side = tok.padding_side, "right"
    return {"tokenizer.padding_side": f"{old} -> right"}


def _pad_right_code(names: Names, **_: Any) -> str:
    return f"""# Pad on the right for training: a left-padded causal row starts with queries that attend to nothing
# (NaN or garbage attention, and the first real token is learned from one). Keep "left" for batched generation.
{names.tokenizer}.padding_side = "right"
"""


def corrected_batch_plan(step: CapturedStep, key: str, rows_changed: Callable[[torch.Tensor], int],
                         correct: Callable[[tuple, dict], tuple[tuple, dict] | None], what: str) -> ShadowPlan:
    """A data fix, verified on the corrected batch: ``rows_changed`` counts the rows it changes per micro-batch
    (read off the ``key`` tensor), ``correct`` turns a micro-batch into the corrected one."""
    count = sum(rows_changed(mb.kwargs[key]) for mb in step.micro_batches if isinstance(mb.kwargs.get(key), torch.Tensor))
    return ShadowPlan(batch=correct, changes={what: count}) if count else ShadowPlan()


def _repad_right(args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """The batch a right-padding tokenizer gives: each row's leading padding moved to its end."""
    mask = kwargs.get("attention_mask")
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        return args, kwargs
    lead = (mask.cumsum(dim=1) == 0).sum(dim=1)  # leading zeros per row
    rows, length = mask.shape
    index = (torch.arange(length, device=mask.device)[None, :] + lead[:, None]) % length

    def move(v: Any) -> Any:
        if isinstance(v, torch.Tensor) and v.dim() == 2 and tuple(v.shape) == (rows, length):
            return v.gather(1, index.to(v.device))
        return v

    return tuple(move(a) for a in args), {k: move(v) for k, v in kwargs.items()}


def _pad_right_plan(step: CapturedStep, **_: Any) -> ShadowPlan:
    """Verified on the corrected batch: the same rows, padded on the right."""
    def left_padded(mask: torch.Tensor) -> int:
        return int(((mask[:, 0] == 0) & (mask.sum(dim=1) > 0)).sum()) if mask.dim() == 2 else 0

    return corrected_batch_plan(step, "attention_mask", left_padded, _repad_right, "rows re-padded on the right")


register(Fix("pad-right-for-training", "Pad on the right for training",
             'Set tokenizer.padding_side = "right" (the collator pads the next batches on the right).',
             _pad_right, _pad_right_code, needs="tokenizer", plan=_pad_right_plan,
             # a left-padded row's first queries attend to nothing: NaN in fp16 SDPA (no change without left padding)
             treats=("invalid-op",), rank=15))


# ---- distinct-pad-token ----------------------------------------------------------------------
def _set_model_pad_id(model: Any, pad_id: int, changed: dict) -> None:
    if getattr(model, "config", None) is not None:
        changed.update(set_pad_token_id(model, pad_id))
    generation = getattr(model, "generation_config", None)
    if generation is not None and getattr(generation, "pad_token_id", None) != pad_id:
        changed[f"{type(generation).__name__}.pad_token_id"] = f"{generation.pad_token_id} -> {pad_id}"
        generation.pad_token_id = pad_id


def _distinct_pad(target: Target, **_: Any) -> dict:
    tok, model = target.tokenizer, target.model
    changed: dict[str, Any] = {}
    if tok.pad_token_id is None or tok.pad_token_id == tok.eos_token_id:
        old = tok.pad_token
        if tok.unk_token is not None and tok.unk_token_id != tok.eos_token_id:
            tok.pad_token = tok.unk_token
        else:
            if model is None:
                raise ValueError("fix 'distinct-pad-token' adds a pad token to the vocabulary and must resize the "
                                 "embeddings: pass model= (or trainer=) with the tokenizer")
            tok.add_special_tokens({"pad_token": PAD_TOKEN})
            rows = model.get_input_embeddings().weight.shape[0]
            if len(tok) > rows:
                model.resize_token_embeddings(len(tok))
                changed["embeddings"] = f"{rows} -> {len(tok)} rows"
        changed["tokenizer.pad_token"] = f"{old!r} -> {tok.pad_token!r}"
    # the tokenizer's pad is distinct from EOS (now, or already): the config and the collator follow it
    if model is not None:
        _set_model_pad_id(model, tok.pad_token_id, changed)
    _set_collator_pad_id(target.trainer, tok.pad_token_id, changed)
    return changed


def _set_collator_pad_id(trainer: Any, pad_id: int, changed: dict) -> None:
    """A collator that took the pad id when the trainer was built (TRL's DataCollatorForPreference and
    DataCollatorForLanguageModeling) keeps padding with the old one: it gets the new id too."""
    collator: Any = getattr(trainer, "data_collator", None)
    old = getattr(collator, "pad_token_id", None)
    if isinstance(old, int) and old != pad_id:
        collator.pad_token_id = pad_id
        changed["trainer.data_collator.pad_token_id"] = f"{old} -> {pad_id}"


def _distinct_pad_code(names: Names, **_: Any) -> str:
    t, m = names.tokenizer, names.model
    collator = "" if names.trainer is None else f"""
# the trainer's collator took the pad id when the trainer was built: it pads with the new one too
if isinstance(getattr({names.trainer}.data_collator, "pad_token_id", None), int):
    {names.trainer}.data_collator.pad_token_id = {t}.pad_token_id
"""
    return f"""# A pad token distinct from EOS. With pad == EOS, a language-modelling collator masks every EOS
# label (the model never learns to stop), and a classification / reward head, which scores the last
# token that is not padding, reads each row one token before its final EOS (or a padding EOS).
if {t}.unk_token is not None and {t}.unk_token_id != {t}.eos_token_id:
    {t}.pad_token = {t}.unk_token
else:
    {t}.add_special_tokens({{"pad_token": "{PAD_TOKEN}"}})
    if len({t}) > {m}.get_input_embeddings().weight.shape[0]:
        {m}.resize_token_embeddings(len({t}))


{inspect.getsource(set_pad_token_id)}

set_pad_token_id({m}, {t}.pad_token_id)
if getattr({m}, "generation_config", None) is not None:
    {m}.generation_config.pad_token_id = {t}.pad_token_id
""" + collator


register(Fix("distinct-pad-token", "Use a pad token distinct from EOS",
             "Pad with the tokenizer's unk token (or a new <|pad|> token, resizing the embeddings) so the "
             "collator stops masking EOS labels.", _distinct_pad, _distinct_pad_code, needs="tokenizer"))


# ---- unshift-labels --------------------------------------------------------------------------
# The fix's cell carries this class's own source: no annotations, no names from this module.
class UnshiftLabels:
    """Wraps a collator whose labels were shifted left by the data and puts them back in line with input_ids."""

    unshifts_labels = True

    def __init__(self, collator):
        self.collator = collator

    def __call__(self, features):
        batch = self.collator(features)
        labels = batch["labels"]
        aligned = torch.full_like(labels, -100)
        aligned[..., 1:] = labels[..., :-1]  # labels[t] was input_ids[t + 1]: now it is input_ids[t]
        batch["labels"] = aligned
        return batch


def _unshift(target: Target, **_: Any) -> dict:
    trainer = target.trainer
    if getattr(trainer.data_collator, UNSHIFT_MARK, False):
        return {}
    trainer.data_collator = UnshiftLabels(trainer.data_collator)
    return {"trainer.data_collator": "labels shifted back in line with input_ids (the model shifts them itself)"}


def _unshift_code(names: Names, **_: Any) -> str:
    t = names.trainer
    return f"""import torch


# The data already shifted the labels (labels[t] == input_ids[t + 1]) and the model shifts them again.
# Better: build labels aligned with input_ids in your preprocessing. Until then, undo the shift per batch.
{inspect.getsource(UnshiftLabels)}

if not getattr({t}.data_collator, "{UNSHIFT_MARK}", False):
    {t}.data_collator = UnshiftLabels({t}.data_collator)
"""


register(Fix("unshift-labels", "Undo the extra label shift",
             "Wrap the trainer's collator so labels line up with input_ids again (the model shifts them itself).",
             _unshift, _unshift_code, needs="trainer"))


# ---- scale-loss-for-accumulation -------------------------------------------------------------
def _flag(trainer: Any) -> str:
    """The switch that makes training_step divide the loss by the accumulation steps."""
    return "loss_is_scaled_for_ga" if hasattr(type(trainer), "loss_is_scaled_for_ga") else "model_accepts_loss_kwargs"


def _scale_loss(target: Target, **_: Any) -> dict:
    trainer = target.trainer
    flag = _flag(trainer)
    if getattr(trainer, flag, None) is False:
        return {}
    old = getattr(trainer, flag, None)
    setattr(trainer, flag, False)
    return {f"trainer.{flag}": f"{old} -> False"}


def _scale_loss_code(names: Names, **_: Any) -> str:
    t = names.trainer
    return f"""# The loss ignores num_items_in_batch, so each micro-batch loss is a mean: let the Trainer divide it by
# gradient_accumulation_steps (or divide the summed loss by num_items_in_batch in your compute_loss).
if hasattr(type({t}), "loss_is_scaled_for_ga"):  # transformers 5
    {t}.loss_is_scaled_for_ga = False
else:  # transformers 4.46+: the Trainer divides when the model takes no loss kwargs
    {t}.model_accepts_loss_kwargs = False
"""


register(Fix("scale-loss-for-accumulation", "Scale the loss for gradient accumulation",
             "Tell the Trainer its loss is a per-micro-batch mean so training_step divides it by the accumulation steps.",
             _scale_loss, _scale_loss_code, needs="trainer"))


# ---- drop-unsupervised-rows ------------------------------------------------------------------
# The fix's cell carries this function's own source: apply filters with it too.
def has_supervised_token(row):
    """Whether the row keeps a label other than -100 after the causal shift (the first label predicts nothing)."""
    return any(int(label) != -100 for label in list(row["labels"])[1:])


def _drop_rows(target: Target, **_: Any) -> dict:
    trainer = target.trainer
    data = trainer.train_dataset
    if data is None:
        raise ValueError("fix 'drop-unsupervised-rows' filters trainer.train_dataset, and this trainer has none")
    rows = len(data)
    if hasattr(data, "filter"):  # a datasets.Dataset
        kept = data.filter(has_supervised_token)
    else:
        kept = [row for row in data if has_supervised_token(row)]
    if len(kept) == rows:
        return {}
    if not len(kept):
        raise ValueError(f"every one of the {rows} rows of trainer.train_dataset has no supervised token (labels all "
                         "-100 after the shift): dropping them leaves nothing to train on; fix the label masking "
                         "(truncation, the response template) instead")
    trainer.train_dataset = kept
    return {"trainer.train_dataset": f"{rows} -> {len(kept)} rows"}


def _drop_rows_code(names: Names, **_: Any) -> str:
    t = names.trainer
    return f"""# Rows whose labels are all -100 (after the causal shift) give a 0/0 loss: drop them from the data.
{inspect.getsource(has_supervised_token)}


if hasattr({t}.train_dataset, "filter"):  # a datasets.Dataset
    {t}.train_dataset = {t}.train_dataset.filter(has_supervised_token)
else:
    {t}.train_dataset = [_row for _row in {t}.train_dataset if has_supervised_token(_row)]
"""


def _drop_unsupervised(args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    labels = kwargs.get("labels")
    if not isinstance(labels, torch.Tensor):  # nothing to judge rows by: leave the micro-batch as it is
        return args, kwargs
    keep = supervised_rows(labels)
    if bool(keep.all()):
        return args, kwargs
    if not bool(keep.any()):
        return None  # the whole micro-batch goes
    rows = labels.shape[0]

    def take(v: Any) -> Any:
        return v[keep] if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == rows else v

    return tuple(take(a) for a in args), {k: take(v) for k, v in kwargs.items()}


def _drop_rows_plan(step: CapturedStep, **_: Any) -> ShadowPlan:
    if not any(isinstance(mb.kwargs.get("labels"), torch.Tensor) for mb in step.micro_batches):
        raise NotCheckable("the step's labels did not reach the model (the trainer keeps them), so the corrected "
                           "batch cannot be built from what was captured")
    return corrected_batch_plan(step, "labels", lambda labels: int((~supervised_rows(labels)).sum()),
                                _drop_unsupervised, "rows dropped")


register(Fix("drop-unsupervised-rows", "Drop rows without a supervised token",
             "Filter trainer.train_dataset to the rows whose labels keep a token other than -100 (after the shift).",
             _drop_rows, _drop_rows_code, needs="trainer", plan=_drop_rows_plan,
             treats=("no-supervised-tokens",), rank=10))
