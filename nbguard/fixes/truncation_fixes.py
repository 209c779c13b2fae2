"""drop-truncated-rows: take out of ``trainer.train_dataset`` the rows a length cap cut inside their answer.

A row that reaches the cap (TRL's ``args.max_length``; for rows tokenized before a plain Trainer, the
longest rows' length) and whose last attended token is not EOS was cut: trained as is, it teaches the
model to stop nowhere. The fix keeps every other row. The audit rule ``answers-cut-by-max-length`` names
the cut rows whose last token is supervised; this fix drops those and any row the cap left with a prompt
only (nothing to learn from either).
"""
from __future__ import annotations

import inspect
from typing import Any

from ..introspect.truncation import MARK, open_at_cap, read_rows, truncation_cap
from .drop_rows import rows_kept
from .registry import Fix, Names, Target, register


def _eos(tokenizer: Any) -> set[int]:
    eos = getattr(tokenizer, "eos_token_id", None)
    return {int(eos)} if isinstance(eos, int) else set()


def _drop_truncated(target: Target, **_: Any) -> dict:
    trainer = target.trainer
    data = getattr(trainer, "train_dataset", None)
    if data is None:
        raise ValueError("fix 'drop-truncated-rows' filters trainer.train_dataset, and this trainer has none")
    eos = _eos(target.tokenizer)
    if not eos:
        raise ValueError("fix 'drop-truncated-rows' needs the tokenizer's eos_token_id (pass tokenizer=, or a trainer "
                         "whose processing_class has one)")
    rows = read_rows(data, None)
    if rows is None:
        raise ValueError("fix 'drop-truncated-rows' reads input_ids from each row of trainer.train_dataset; these rows "
                         "have none (an iterable dataset, or untokenized text)")
    cap = truncation_cap(trainer, rows, eos)
    drop = set(open_at_cap(rows, cap.length, eos)) if cap is not None else set()
    if not drop or cap is None:
        return {}
    keep = [i for i in range(len(rows.input_ids)) if i not in drop]
    trainer.train_dataset = rows_kept(data, keep, MARK, cap.length)  # a second apply (or audit) reads the same cap
    return {"trainer.train_dataset": f"{len(rows.input_ids)} -> {len(keep)} rows (dropped {len(drop)} cut at "
                                     f"max_length={cap.length} without EOS: dataset indices {sorted(drop)[:20]}"
                                     + (" ..." if len(drop) > 20 else "") + ")"}


def _drop_truncated_code(names: Names, **_: Any) -> str:
    t = names.trainer
    return f"""import torch

{inspect.getsource(rows_kept)}

# Rows that reach max_length and end without EOS: the cap fell inside their answer, so the model is taught
# to stop nowhere. Drop them (or rebuild the dataset with a max_length that covers them, within the model's context).
_data = {t}.train_dataset
_eos = {names.tokenizer}.eos_token_id


def _attended(row):
    ids, mask = [int(i) for i in row["input_ids"]], row.get("attention_mask")
    return ids if mask is None else [i for i, m in zip(ids, mask) if m]


_rows = [_attended(_data[_i]) for _i in range(len(_data))]
# TRL's max_length; for rows tokenized with truncation=True, max_length=N before a plain Trainer, the longest rows
_cap = getattr({t}.args, "max_length", None) or getattr(_data, "{MARK}", None) or max(map(len, _rows))
_keep = [_i for _i, _r in enumerate(_rows) if len(_r) < _cap or _r[-1] == _eos]
print(f"dropped {{len(_data) - len(_keep)}} rows cut at {{_cap}} tokens; {{len(_keep)}} left")
{t}.train_dataset = rows_kept(_data, _keep, "{MARK}", _cap)  # marked: running this cell again drops nothing more
"""


register(Fix("drop-truncated-rows", "Drop the rows max_length cut inside their answer",
             "Filter out of trainer.train_dataset the rows that reach the length cap (TRL's max_length, or the cap "
             "the rows were tokenized with) and end without EOS.", _drop_truncated, _drop_truncated_code,
             needs="trainer"))
