"""Rows a length cap cut, and the context a model's positions cover: facts the audit and the fixes share.

A training row "cut by max_length" reaches the cap (TRL's ``SFTConfig.max_length``, or a tokenizer's
``truncation=True, max_length=N`` before a plain Trainer) and ends on a token that is not EOS: the
answer was truncated, and the model is taught to stop nowhere. The rows are read as the trainer holds
them (``trainer.train_dataset``: TRL's prepared rows with their ``labels``; a plain Trainer's tokenized
rows), so the indices named are indices of ``trainer.train_dataset``.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

IGNORE_INDEX = -100
COLUMNS = ("input_ids", "attention_mask", "labels")
MARK = "nbguard_truncation_cap"  # set on the rows drop-truncated-rows kept: the cap they were cut at


def as_ints(value: Any) -> list[int] | None:
    """A row's column as a list of ints (lists and tensors alike), None when it is not one."""
    if value is None or isinstance(value, (str, bytes)):
        return None
    tolist = getattr(value, "tolist", None)
    if callable(tolist):
        value = tolist()
    if not isinstance(value, Sequence) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return None
    return list(value)


@dataclass
class TrainingRows:
    """The first rows of ``trainer.train_dataset``, as token id lists (index i is dataset index i)."""

    input_ids: list[list[int]]
    attention_mask: list[list[int] | None]
    labels: list[list[int] | None]
    dataset_rows: int  # how many rows the dataset holds in all

    def real_positions(self, i: int) -> tuple[int, int]:
        """(number of attended tokens, position of the last one) of row i (a padded row's mask says which)."""
        ids, mask = self.input_ids[i], self.attention_mask[i]
        if mask is None or len(mask) != len(ids):
            return len(ids), len(ids) - 1
        last = max((p for p, m in enumerate(mask) if m), default=-1)
        return sum(1 for m in mask if m), last

    @property
    def longest(self) -> int:
        return max((self.real_positions(i)[0] for i in range(len(self.input_ids))), default=0)


def read_rows(dataset: Any, limit: int | None) -> TrainingRows | None:
    """The first ``limit`` rows (all of them when None) of a map-style dataset with an ``input_ids`` column;
    None for an iterable dataset or rows without token ids (a raw text dataset, preference pairs)."""
    if dataset is None or not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
        return None
    total = len(dataset)
    n = total if limit is None else min(total, limit)
    names = getattr(dataset, "column_names", None)
    if isinstance(names, list):  # a datasets.Dataset: read only the columns needed, n rows at once
        columns = [c for c in COLUMNS if c in names]
        if "input_ids" not in columns:
            return None
        part = dataset.select_columns(columns)[:n] if hasattr(dataset, "select_columns") else dataset[:n]
        rows: list[Mapping] = [{c: part[c][i] for c in columns} for i in range(n)]
    else:
        rows = [dataset[i] for i in range(n)]
    ids, masks, labels = [], [], []
    for row in rows:
        if not isinstance(row, Mapping):
            return None
        row_ids = as_ints(row.get("input_ids"))
        if row_ids is None:
            return None
        ids.append(row_ids)
        masks.append(as_ints(row.get("attention_mask")))
        labels.append(as_ints(row.get("labels")))
    return TrainingRows(ids, masks, labels, total)


@dataclass
class Cap:
    length: int
    source: str  # where the cap was read: "SFTConfig.max_length" or "inferred"


def configured_max_length(trainer: Any) -> int | None:
    """The trainer's own sequence cap (TRL's ``args.max_length``), when it has one."""
    value = getattr(getattr(trainer, "args", None), "max_length", None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def packs(trainer: Any) -> bool:
    """TRL packs several examples into each row (``args.packing``): rows are no longer examples."""
    return bool(getattr(getattr(trainer, "args", None), "packing", False))


def truncation_cap(trainer: Any, rows: TrainingRows, eos: set[int]) -> Cap | None:
    """The length rows were cut at: the trainer's ``max_length``, else (rows tokenized before a plain Trainer)
    the longest row's length where two or more rows stop there without EOS while shorter rows end with it
    (the pile-up ``truncation=True, max_length=N`` leaves). None when nothing says the rows were capped."""
    configured = configured_max_length(trainer)
    if configured is not None:
        return Cap(configured, f"{type(getattr(trainer, 'args', None)).__name__}.max_length")
    marked = getattr(getattr(trainer, "train_dataset", None), MARK, None)
    if isinstance(marked, int):  # drop-truncated-rows left the cap it inferred on the rows it kept
        return Cap(marked, "inferred")
    if not eos or not rows.input_ids:
        return None
    longest = rows.longest
    at_cap_open, shorter_closed = 0, False
    for i, ids in enumerate(rows.input_ids):
        n, last = rows.real_positions(i)
        if n <= 0:
            continue
        if n == longest and ids[last] not in eos:
            at_cap_open += 1
        elif n < longest and ids[last] in eos:
            shorter_closed = True
    return Cap(longest, "inferred") if at_cap_open >= 2 and shorter_closed else None


def open_at_cap(rows: TrainingRows, cap: int, eos: set[int]) -> list[int]:
    """Indices of the rows that reach ``cap`` and whose last attended token is not EOS."""
    out = []
    for i, ids in enumerate(rows.input_ids):
        n, last = rows.real_positions(i)
        if n >= cap and last >= 0 and ids[last] not in eos:
            out.append(i)
    return out


@dataclass
class Coverage:
    """The positions a model's config covers: its own and what a RoPE scaling stretches them to."""

    max_position_embeddings: int
    covered: int  # the longest sequence the positions (and scaling) cover
    rope_type: str | None  # None: no rotary embedding in the config (learned absolute positions, ALiBi...)
    factor: float | None = None
    original: int | None = None  # original_max_position_embeddings (pretraining length) where scaling says it
    notes: list[str] = field(default_factory=list)

    def to_evidence(self) -> dict[str, Any]:
        return {"max_position_embeddings": self.max_position_embeddings, "covered_length": self.covered,
                "rope_type": self.rope_type, "rope_factor": self.factor,
                "original_max_position_embeddings": self.original}


SCALED = ("linear", "dynamic", "yarn", "llama3", "longrope")


def _rope(config: Any) -> dict | None:
    """The config's RoPE parameters (``rope_parameters`` in transformers 5, ``rope_scaling`` before), the
    full-attention entry of per-layer-type parameters (Gemma 3)."""
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, Mapping) or not params:
        scaling = getattr(config, "rope_scaling", None)
        params = dict(scaling) if isinstance(scaling, Mapping) else None
        if params is None and getattr(config, "rope_theta", None) is not None:
            params = {"rope_type": "default"}
    if isinstance(params, Mapping) and params and all(isinstance(v, Mapping) for v in params.values()):
        params = params.get("full_attention") or next(iter(params.values()))
    return dict(params) if isinstance(params, Mapping) else None


def position_coverage(config: Any) -> Coverage | None:
    """What ``config``'s positions cover, None without a ``max_position_embeddings``.

    No scaling: ``max_position_embeddings``. A scaling (linear, dynamic, yarn, llama3, longrope) with a
    ``factor``: ``original_max_position_embeddings`` (else ``max_position_embeddings``) times the factor, and at
    least ``max_position_embeddings`` (configs that already list the stretched length keep it)."""
    mpe = getattr(config, "max_position_embeddings", None)
    if not isinstance(mpe, int) or isinstance(mpe, bool) or mpe <= 0:
        return None
    rope = _rope(config)
    if rope is None:
        return Coverage(mpe, mpe, None)
    kind = rope.get("rope_type") or rope.get("type") or "default"
    original = rope.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings",
                                                                        None)
    original = original if isinstance(original, int) and original > 0 else None
    factor = rope.get("factor")
    factor = float(factor) if isinstance(factor, (int, float)) and not isinstance(factor, bool) else None
    if kind not in SCALED:
        return Coverage(mpe, mpe, str(kind))
    if factor is None and kind in ("yarn", "longrope") and original:
        factor = mpe / original  # transformers derives it so when only the two lengths are given
    if factor is None or factor <= 0:
        return Coverage(mpe, mpe, str(kind), None, original, [f"{kind} scaling without a factor"])
    covered = max(mpe, int((original or mpe) * factor))
    notes = ["dynamic NTK rescales past this length too, but the model then runs on positions its "
             "scaled frequencies were not tuned for"] if kind == "dynamic" else []
    return Coverage(mpe, covered, str(kind), factor, original, notes)
