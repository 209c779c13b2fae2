"""Rules about the batches the model will train on: labels and attention masks that make the loss undefined.

The batches are the one given to the audit (``batch=``) or a few sampled from the trainer's own
dataloader (:mod:`nbguard.auditor.sampling`); each finding says which in its evidence.
"""
from __future__ import annotations

from typing import Any

import torch

from ...document.view import plural
from ...introspect.tokenizers import loaded_from
from ..registry import capped, finding, rule

IGNORE_INDEX = -100


def _is_causal_lm(ctx) -> bool:
    cfg = ctx.config
    return cfg is not None and not getattr(cfg, "is_encoder_decoder", False)


def scored_labels(ctx, labels: torch.Tensor) -> torch.Tensor:
    """The labels the loss really scores: causal LMs shift by one, so a row's first label is never predicted."""
    return labels[:, 1:] if _is_causal_lm(ctx) else labels


def batch_labels(ctx) -> list[torch.Tensor]:
    """Each sampled batch's 2-D labels (batches without labels are skipped)."""
    out = []
    for batch in ctx.batches:
        labels = batch.get("labels")
        if isinstance(labels, torch.Tensor) and labels.dim() == 2:
            out.append(labels)
    return out


def _row_ids(per_batch: list[torch.Tensor]) -> list[Any]:
    """Row indices, as ``row`` for one batch or ``[batch, row]`` across several."""
    if len(per_batch) == 1:
        return per_batch[0].nonzero().flatten().tolist()
    return [[b, r] for b, rows in enumerate(per_batch) for r in rows.nonzero().flatten().tolist()]


@rule("batch-sampling-error", "warning")
def batch_sampling_error(ctx):
    """The trainer's own dataloader raised while the audit drew batches from it: train() will too."""
    error = ctx.sample.error if ctx.trainer is not None and ctx.batch is None else None
    if error is None:
        return None
    return finding(
        "batch-sampling-error",
        "the trainer's dataloader raised while the audit sampled it",
        f"trainer.get_train_dataloader() (dataset, column removal, collator) raised {error}. train() builds the same "
        "loader and will fail the same way; the batch rules (labels, padding) could not look at any batch.",
        {"exception": error},
    )


def loss_normalisation(ctx) -> tuple[bool, int]:
    """(normalised by num_items_in_batch, micro-batches per optimizer step) for the run the audit sees.

    The Trainer sums the loss and divides by the supervised tokens of the whole accumulated step when the
    model accepts loss kwargs (or a compute_loss_func is set): Trainer._get_num_items_in_batch. Otherwise
    each micro-batch takes its own mean. Without a trainer the user's loop is unknown: a per-batch mean.
    """
    trainer = ctx.trainer
    if trainer is None:
        return False, 1
    by_items = bool(getattr(trainer, "model_accepts_loss_kwargs", False)
                    or getattr(trainer, "compute_loss_func", None) is not None) and not _own_compute_loss(trainer)
    steps = int(getattr(ctx.args, "gradient_accumulation_steps", 1) or 1)
    return by_items, steps


def _divisor_counts_shifted(trainer) -> bool:
    """Whether this Trainer counts num_items_in_batch over the shifted labels (transformers after 5.9 marks
    it with ``_loss_shifts_labels``); older ones count every label that is not -100, the first included."""
    return hasattr(trainer, "_loss_shifts_labels")


def _own_compute_loss(trainer) -> bool:
    """A compute_loss written outside transformers/TRL (a user's subclass): how it normalises is unknown,
    so the rule assumes the common per-batch mean (``sum(loss * mask) / mask.sum()``)."""
    owner = next((c for c in type(trainer).__mro__ if "compute_loss" in vars(c)), None)
    module = getattr(owner, "__module__", "") or ""
    return not module.startswith(("transformers.", "trl."))


@rule("no-supervised-tokens", "error")
def no_supervised_tokens(ctx):
    """Rows or batches whose labels are all -100: an error when a step's loss can be 0/0, else examples that teach nothing."""
    all_labels = batch_labels(ctx)
    if not all_labels:
        return None
    empty = [(scored_labels(ctx, labels) == IGNORE_INDEX).all(dim=1) for labels in all_labels]
    n_empty = sum(int(e.sum()) for e in empty)
    if n_empty == 0:
        return None
    rows_seen = sum(int(e.numel()) for e in empty)
    whole = [i for i, e in enumerate(empty) if bool(e.all())]
    share = n_empty / rows_seen
    by_items, accumulation = loss_normalisation(ctx)
    # 0/0 needs every micro-batch the divisor counts to be empty: one micro-batch under a per-batch mean,
    # all of a step's micro-batches under num_items_in_batch. Trainers before the shifted count
    # (transformers <= 5.9) count labels before the causal shift: a row with only its first label has a
    # divisor of 1 and a loss of 0, not NaN.
    unshifted_divisor = by_items and not _divisor_counts_shifted(ctx.trainer)
    zero_divisor = [i for i in whole if not unshifted_divisor or bool((all_labels[i] == IGNORE_INDEX).all())]
    nan_step = bool(zero_divisor) and (not by_items or accumulation == 1 or len(zero_divisor) == len(empty))
    how = (f"The Trainer divides each step's summed loss by the supervised tokens of all {accumulation} "
           "accumulated micro-batches (num_items_in_batch)" if by_items and accumulation > 1 else
           "The Trainer divides each step's summed loss by its supervised tokens (num_items_in_batch)" if by_items
           else "Each micro-batch's loss is the mean over its own supervised tokens")
    if whole:
        title = ("the batch has no supervised tokens" if len(empty) == 1
                 else f"{len(whole)} of {plural(len(empty), 'sampled batch', 'es')} have no supervised tokens")
        if nan_step:
            detail = (f"Every label in {'the batch' if len(empty) == 1 else 'such a batch'} is -100 (after the causal "
                      f"shift). {how}, so that step's loss is 0/0 = NaN with no bad module at all. ")
        elif unshifted_divisor and len(zero_divisor) < len(whole):
            detail = (f"Every label in such a batch is -100 after the causal shift. {how}, counted before the shift "
                      "in this transformers release, so the divisor is at least 1 and the step's loss is exactly 0: "
                      "it contributes nothing, while the optimizer still steps (AdamW's momentum and weight decay "
                      "move the weights). It is compute spent on examples the model never learns from. ")
        else:
            detail = (f"Every label in such a batch is -100 (after the causal shift). {how}, so an empty micro-batch "
                      "adds 0 to the sum and nothing to the divisor: it contributes nothing and the loss stays "
                      f"finite (0/0 only if all {accumulation} micro-batches of a step were empty). It is compute spent "
                      "on examples the model never learns from. ")
    else:
        title = (f"{plural(n_empty, 'row')} {'has' if n_empty == 1 else 'have'} no supervised tokens"
                 if len(empty) == 1 else
                 f"{n_empty} of {plural(rows_seen, 'sampled row')} ({share:.0%}) have no supervised tokens")
        detail = (f"These rows are all -100 (after the causal shift). {how}; the other rows keep it finite, so such a "
                  "row contributes nothing: an example the model never learns from (a completion-only collator that "
                  "did not find its response template, or truncation that cut the answer away, leaves exactly "
                  "this). ")
    tok = ctx.tokenizer
    if tok is not None:  # the labels come from its encoding: name it (a tokenizer encoding text to nothing is a cause)
        folder = loaded_from(tok)
        detail += (f"The rows were encoded by {type(tok).__name__}" + (f" loaded from {folder}" if folder else "")
                   + "; a tokenizer that encodes text to nothing leaves only special tokens to train on. ")
    evidence = {"tokenizer_class": type(tok).__name__ if tok is not None else None,
                "tokenizer_loaded_from": loaded_from(tok) if tok is not None else None,
                "rows": capped(_row_ids(empty)), "batch_size": int(all_labels[0].shape[0]),
                "shifted": _is_causal_lm(ctx), "rows_seen": rows_seen, "empty_share": share,
                "empty_batches": whole, "normalised_by_num_items": by_items,
                "gradient_accumulation_steps": accumulation, "loss_can_be_nan": nan_step, **ctx.sample.to_evidence()}
    return finding(
        "no-supervised-tokens", title,
        detail + "Drop examples whose prompt fills the whole sequence, truncate prompts so some answer tokens remain, "
                 "or check that the response template is found in every example.",
        evidence, severity="error" if nan_step else "warning",
    )


@rule("fully-masked-rows", "warning")
def fully_masked_rows(ctx):
    """attention_mask rows that attend to nothing."""
    masks = [b["attention_mask"] for b in ctx.batches
             if isinstance(b.get("attention_mask"), torch.Tensor) and b["attention_mask"].dim() == 2]
    if not masks:
        return None
    empty = [(mask == 0).all(dim=1) for mask in masks]
    n_empty = sum(int(e.sum()) for e in empty)
    if n_empty == 0:
        return None
    return finding(
        "fully-masked-rows",
        f"{n_empty} row(s) of attention_mask attend to nothing",
        "A query whose keys are all masked has a softmax over nothing. Current PyTorch (2.5 and later) gives "
        "such a row zeros in sdpa, and transformers' eager attention, which masks with the dtype's minimum, "
        "an average over the padding; but older PyTorch's sdpa and attention code that masks with -inf "
        "compute 0/0 = NaN there, which spreads through the loss or the gradients to the whole step. Even "
        "where it stays finite the row is pure padding, computed for nothing. Remove padding-only rows from "
        "the batch.",
        {"rows": capped(_row_ids(empty)), "batch_size": int(masks[0].shape[0]), **ctx.sample.to_evidence()},
    )
