"""Rules about a sample batch: labels and attention masks that make the loss undefined."""
from __future__ import annotations

from ..registry import capped, finding, rule

IGNORE_INDEX = -100


def _is_causal_lm(ctx) -> bool:
    cfg = ctx.config
    return cfg is not None and not getattr(cfg, "is_encoder_decoder", False)


@rule("no-supervised-tokens", "error")
def no_supervised_tokens(ctx):
    """Rows (or the whole batch) whose labels are all -100: a 0/0 mean loss."""
    labels = ctx.batch.get("labels") if ctx.batch else None
    if labels is None or labels.dim() != 2:
        return None
    # Causal LMs shift labels by one: the first label of each row is never predicted.
    scored = labels[:, 1:] if _is_causal_lm(ctx) else labels
    empty = (scored == IGNORE_INDEX).all(dim=1)
    n_empty = int(empty.sum())
    if n_empty == 0:
        return None
    whole = n_empty == labels.shape[0]
    return finding(
        "no-supervised-tokens",
        "the batch has no supervised tokens" if whole else f"{n_empty} row(s) have no supervised tokens",
        ("Every label in the batch is -100 (after the causal shift), so the mean cross-entropy is 0/0 = NaN "
         "with no bad module at all. " if whole else
         "These rows are all -100 (after the causal shift). In this batch the other rows keep the loss finite, "
         "but a micro-batch made only of such rows gives a 0/0 = NaN loss. ")
        + "Drop examples whose prompt fills the whole sequence, or truncate prompts so some answer tokens remain.",
        {"rows": capped(empty.nonzero().flatten().tolist()), "batch_size": labels.shape[0],
         "shifted": _is_causal_lm(ctx)},
        severity="error" if whole else "warning",
    )


@rule("fully-masked-rows", "warning")
def fully_masked_rows(ctx):
    """attention_mask rows that attend to nothing."""
    mask = ctx.batch.get("attention_mask") if ctx.batch else None
    if mask is None or mask.dim() != 2:
        return None
    empty = (mask == 0).all(dim=1)
    if not bool(empty.any()):
        return None
    return finding(
        "fully-masked-rows",
        f"{int(empty.sum())} row(s) of attention_mask attend to nothing",
        "A query whose keys are all masked has a softmax over nothing. Current PyTorch (2.5 and later) gives "
        "such a row zeros in sdpa, and transformers' eager attention, which masks with the dtype's minimum, "
        "an average over the padding; but older PyTorch's sdpa and attention code that masks with -inf "
        "compute 0/0 = NaN there, which spreads through the loss or the gradients to the whole step. Even "
        "where it stays finite the row is pure padding, computed for nothing. Remove padding-only rows from "
        "the batch.",
        {"rows": capped(empty.nonzero().flatten().tolist()), "batch_size": mask.shape[0]},
    )
