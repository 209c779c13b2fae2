"""Truncation and context: answers cut by ``max_length``, and training lengths past the model's positions.

``answers-cut-by-max-length`` reads ``trainer.train_dataset`` as the trainer will train on it (TRL's
prepared rows, truncated to ``SFTConfig.max_length`` and carrying their labels; a plain Trainer's tokenized
rows, whose labels its collator builds) and counts the supervised rows that reach the cap and end on a
token that is not EOS: the answer was cut, and the model never learns to stop there (open-instruct#1876
measured 2% of a mix). ``max-length-beyond-positions`` compares the longest position the trainer will feed
with what the config's positions cover, RoPE scaling (linear, dynamic, yarn, llama3, longrope) included
(unsloth#3083).
"""
from __future__ import annotations

from inspect import signature
from typing import Any

import torch

from ...introspect.modes import in_training_mode
from ...introspect.truncation import (
    IGNORE_INDEX,
    TrainingRows,
    configured_max_length,
    open_at_cap,
    packs,
    position_coverage,
    read_rows,
    truncation_cap,
)
from ...step.capture import preserved_rng
from ..registry import capped, finding, rule
from .labels import eos_and_pad_ids

ROWS_CHECKED = 4096  # rows read from the dataset's start: a share of a few percent is well resolved
WARN_SHARE = 0.01  # above this share of supervised rows the finding is a warning, else info
ROWS_NAMED = 50  # dataset indices listed in the evidence (the count says how many in all)
PROBE_TOKENS = 16384  # the longest row the position probe feeds
PROBE_POSITIONS = 256  # positions scored on each side of the covered length
PROBE_FLOPS = {"cpu": 2e11, "other": 5e13}  # forward cost (2 x parameters x tokens) the probe may spend


def training_rows(ctx) -> TrainingRows | None:
    """The first rows of ``trainer.train_dataset``, read once per audit (both rules use them)."""
    cache = ctx.__dict__
    if "_truncation_rows" not in cache:
        dataset = getattr(ctx.trainer, "train_dataset", None)
        cache["_truncation_rows"] = read_rows(dataset, ROWS_CHECKED) if dataset is not None else None
    return cache["_truncation_rows"]


def _collated_labels(ctx, ids: list[int], mask: list[int] | None) -> list[int] | None:
    """The labels the trainer's collator builds for one row (a plain Trainer's rows carry none)."""
    collator = getattr(ctx.trainer, "data_collator", None)
    if not callable(collator):
        return None
    feature: dict[str, Any] = {"input_ids": ids, **({"attention_mask": mask} if mask is not None else {})}
    out = collator([feature])
    labels = out.get("labels") if hasattr(out, "get") else None
    if not isinstance(labels, torch.Tensor) or labels.dim() != 2 or labels.shape[1] < len(ids):
        return None
    side = getattr(ctx.tokenizer, "padding_side", "right")
    start = labels.shape[1] - len(ids) if side == "left" else 0
    return labels[0, start:start + len(ids)].tolist()


def _supervised(ctx, rows: TrainingRows, i: int) -> list[int] | None:
    """Row i's labels: its own column, else what the collator builds; None when neither says."""
    labels = rows.labels[i]
    if labels is not None and len(labels) == len(rows.input_ids[i]):
        return labels
    return _collated_labels(ctx, rows.input_ids[i], rows.attention_mask[i])


@rule("answers-cut-by-max-length", "warning")
def answers_cut_by_max_length(ctx):
    """Supervised rows that reach max_length and end without EOS: the cap cut the answer, and the model is never taught to stop (rows named by dataset index)."""
    if ctx.trainer is None or packs(ctx.trainer):
        return None  # packed rows are not examples: where one ends is not where the cap fell
    rows = training_rows(ctx)
    eos, _ = eos_and_pad_ids(ctx)
    if rows is None or not rows.input_ids or not eos:
        return None
    cap = truncation_cap(ctx.trainer, rows, eos)
    if cap is None:
        return None
    cut = []
    for i in open_at_cap(rows, cap.length, eos):
        labels = _supervised(ctx, rows, i)
        last = rows.real_positions(i)[1]
        if labels is None or labels[last] != IGNORE_INDEX:  # the supervised span runs to the cut
            cut.append(i)
    if not cut:
        return None
    supervised = sum(1 for labels in rows.labels if labels is None or any(x != IGNORE_INDEX for x in labels))
    share = len(cut) / max(supervised, 1)
    checked = len(rows.input_ids)
    where = (f"the first {checked} of {rows.dataset_rows} rows" if checked < rows.dataset_rows
             else f"all {checked} rows")
    cap_said = (f"{cap.source}={cap.length}" if cap.source != "inferred" else
                f"a cap of {cap.length} tokens (the longest rows stop there without EOS while shorter rows end "
                "with it: tokenized with truncation=True, max_length=" f"{cap.length})")
    return finding(
        "answers-cut-by-max-length",
        f"{len(cut)} of {supervised} supervised rows ({share:.1%}) end at max_length={cap.length} without EOS: "
        "their answers were cut",
        f"In {where} of trainer.train_dataset, {len(cut)} rows reach {cap_said} and their last supervised token is "
        "not EOS: the cap fell inside the answer. The model learns these answers as if they stopped mid-way "
        "with no end-of-sequence, so it is taught to stop nowhere on long answers (open-instruct#1876 measured "
        "2% of a mix). Rebuild the dataset with a max_length that covers the longest rows (within the model's "
        "context: see max-length-beyond-positions), or drop the cut rows (drop-truncated-rows).",
        {"rows": capped(cut, ROWS_NAMED), "share": share, "supervised_rows": supervised, "rows_checked": checked,
         "dataset_rows": rows.dataset_rows, "max_length": cap.length, "cap_source": cap.source,
         "eos_token_id": sorted(eos), "warn_above_share": WARN_SHARE},
        fixes=["drop-truncated-rows"],
        severity="warning" if share > WARN_SHARE else "info")


def _batch_positions(batch: dict) -> int:
    """The longest position a batch feeds: position_ids where the collator sends them (packed, padding-free
    rows restart at 0), else the attended tokens of the longest row."""
    positions, mask, ids = batch.get("position_ids"), batch.get("attention_mask"), batch.get("input_ids")
    if isinstance(positions, torch.Tensor) and positions.numel():
        return int(positions.max()) + 1
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.numel():
        return int(mask.long().sum(dim=1).max())
    return int(ids.shape[-1]) if isinstance(ids, torch.Tensor) and ids.dim() >= 1 else 0


def _absolute_positions(ctx, size: int) -> str | None:
    """The name of a learned position-embedding table with ``size`` rows (GPT-2's wpe, OPT's embed_positions)."""
    for name, module in ctx.modules:
        if isinstance(module, torch.nn.Embedding) and module.num_embeddings in (size, size + 2) \
                and any(key in name.rsplit(".", 1)[-1] for key in ("pos", "wpe")):
            return name
    return None


def position_loss(ctx, rows: TrainingRows | None, covered: int) -> dict[str, Any] | None:
    """With ``audit(probe=True)``: one forward of the longest training row (no gradients, modes and RNG put back),
    the next-token loss at up to PROBE_POSITIONS positions before the covered length and as many past it. On a
    pretrained model the loss past the covered length rises; a random-init model has no position knowledge to
    lose (its loss is near ln(vocab) everywhere), so there the numbers say nothing."""
    model = ctx.model
    if ctx.probe is None or rows is None or not rows.input_ids or model is None or not ctx.named_params:
        return None
    device = ctx.named_params[0][1].device
    if device.type == "meta":
        return None
    longest = max(range(len(rows.input_ids)), key=lambda i: rows.real_positions(i)[0])
    ids, mask = rows.input_ids[longest], rows.attention_mask[longest]
    ids = [t for t, m in zip(ids, mask) if m] if mask is not None and len(mask) == len(ids) else ids
    ids = ids[:PROBE_TOKENS]
    if len(ids) < covered + 2:
        return None
    flops = 2 * sum(p.numel() for _, p in ctx.named_params) * len(ids)
    if flops > PROBE_FLOPS["cpu" if device.type == "cpu" else "other"]:
        return {"skipped": f"one forward of {len(ids)} tokens would cost ~{flops:.1e} FLOPs on {device.type}"}
    before = list(range(max(0, covered - PROBE_POSITIONS), covered))
    after = list(range(covered, min(len(ids) - 1, covered + PROBE_POSITIONS)))
    keep = torch.tensor(before + after, device=device)
    kwargs: dict[str, Any] = {"logits_to_keep": keep} if "logits_to_keep" in signature(model.forward).parameters \
        else {}
    with preserved_rng(), in_training_mode(model), torch.no_grad():
        logits = model(input_ids=torch.tensor([ids], device=device), **kwargs).logits[0]
    if not kwargs:
        logits = logits[keep]
    targets = torch.tensor(ids, device=device)[keep + 1]
    loss = torch.nn.functional.cross_entropy(logits.float(), targets, reduction="none")
    within, beyond = loss[:len(before)].mean().item(), loss[len(before):].mean().item()
    return {"dataset_row": longest, "tokens": len(ids), "positions_within": len(before),
            "positions_beyond": len(after), "mean_loss_within": within, "mean_loss_beyond": beyond,
            "ratio": beyond / within if within > 0 else None}


@rule("max-length-beyond-positions", "warning")
def max_length_beyond_positions(ctx):
    """Training rows longer than the positions the model covers: max_position_embeddings, or what its RoPE scaling (linear, dynamic, yarn, llama3, longrope) stretches them to."""
    coverage = position_coverage(ctx.text_config) if ctx.text_config is not None else None
    if coverage is None:
        return None
    rows = None if packs(ctx.trainer) else training_rows(ctx)  # packed rows restart their positions per example
    from_rows = rows.longest if rows is not None else 0
    from_batches = max((_batch_positions(b) for b in ctx.batches), default=0)
    length = max(from_rows, from_batches)
    if length <= coverage.covered:
        return None
    configured = configured_max_length(ctx.trainer)
    evidence = {"training_length": length, "longest_dataset_row": from_rows, "longest_batch_position": from_batches,
                "configured_max_length": configured, **coverage.to_evidence(), **ctx.sample.to_evidence()}
    table = _absolute_positions(ctx, coverage.max_position_embeddings) if coverage.rope_type is None else None
    if table is not None:
        return finding(
            "max-length-beyond-positions",
            f"rows of {length} tokens, and the model's learned position table ({table}) has "
            f"{coverage.max_position_embeddings} rows",
            f"Learned absolute positions stop at {coverage.max_position_embeddings}: the forward on the first row "
            "longer than that raises IndexError ('index out of range in self'; a device-side assert on a GPU). "
            f"Set max_length to {coverage.max_position_embeddings} or less, or use a model with longer positions.",
            {**evidence, "position_table": table}, severity="error")
    if coverage.rope_type in (None, "default") or coverage.factor is None:
        factor = -(-length // coverage.max_position_embeddings)
        how = (f"max_position_embeddings is {coverage.max_position_embeddings} and the config has no RoPE scaling: "
               f"positions {coverage.max_position_embeddings}..{length - 1} use rotary angles the model never saw "
               "in pre-training. Their loss stays high, and fitting them drags the short-context behaviour with it "
               "(unsloth#3083). Either lower max_length to "
               f"{coverage.covered}, or load the model with a scaling that covers {length} tokens, e.g. "
               f"rope_scaling={{'rope_type': 'yarn', 'factor': {float(factor)}, "
               f"'original_max_position_embeddings': {coverage.max_position_embeddings}}} "
               "(the rotary tables are built at load time: set it on the config before from_pretrained).")
    else:
        base = coverage.original or coverage.max_position_embeddings
        factor = -(-length // base)
        how = (f"The {coverage.rope_type} scaling (factor {coverage.factor:g} over {base} original positions) "
               f"covers {coverage.covered} tokens, and rows reach {length}: the positions past {coverage.covered} "
               "are beyond what the scaling was set for. "
               + (coverage.notes[0] + ". " if coverage.notes else "")
               + f"Raise the factor to {float(factor)} (set it on the config before from_pretrained), or lower "
               f"max_length to {coverage.covered}.")
    probe = position_loss(ctx, rows, coverage.covered)
    if probe is not None and "skipped" not in probe:
        how += (f" The probe (one forward of dataset row {probe['dataset_row']}): mean next-token loss "
                f"{probe['mean_loss_within']:.3f} over the {probe['positions_within']} positions before "
                f"{coverage.covered}, {probe['mean_loss_beyond']:.3f} over the {probe['positions_beyond']} positions past it "
                "(a pretrained model's loss rises past the covered length; a random-init one's does not).")
    return finding(
        "max-length-beyond-positions",
        f"rows of {length} tokens, beyond the {coverage.covered} positions the model covers",
        how, {**evidence, **({"position_loss": probe} if probe is not None else {})})
