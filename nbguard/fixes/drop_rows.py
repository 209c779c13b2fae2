"""drop-rows: filter the rows a watch event named (by dataset index) out of the Trainer's training data.

The watch names the rows of a bad step by the dataset indices its sampler drew
(``event.evidence["rows"]["dataset_indices"]``, :mod:`nbguard.watcher.rows`); this fix drops exactly
those rows. ``indices=`` lists them, or ``path=`` reads them from the JSON file
``nbguard.watcher.rows.save_rows`` wrote (its ``dataset_indices``).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from .registry import Fix, Names, Target, register


def read_indices(indices: Any = None, path: str | Path | None = None) -> list[int]:
    """The dataset indices to drop, from ``indices`` or the JSON file at ``path``."""
    if indices is None and path is not None:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        indices = data.get("dataset_indices") if isinstance(data, dict) else data
    if indices is None:
        raise ValueError("fix 'drop-rows' needs indices=[...] (the dataset indices an event named) or path= (the "
                         "JSON file nbguard.watcher.rows.save_rows wrote)")
    if not isinstance(indices, (list, tuple, set)) or not all(isinstance(i, int) and not isinstance(i, bool)
                                                                for i in indices):
        raise ValueError(f"fix 'drop-rows': indices must be a list of dataset indices (ints), got {indices!r}")
    return sorted(set(indices))


def rows_kept(data: Any, keep: list[int], mark: str, value: Any) -> Any:
    """``data`` with only the rows at ``keep``, of the dataset's own kind (a datasets.Dataset, a list, else a
    Subset), marked with ``mark`` = ``value`` where the kind takes an attribute (a list does not)."""
    if hasattr(data, "select"):  # a datasets.Dataset
        kept = data.select(keep)
    elif isinstance(data, list):
        kept = [data[i] for i in keep]
    else:
        kept = torch.utils.data.Subset(data, keep)
    try:
        setattr(kept, mark, value)
    except (AttributeError, TypeError):  # a list: nothing marks it
        pass
    return kept


def _drop(target: Target, indices: Any = None, path: str | None = None, **_: Any) -> dict:
    drop = read_indices(indices, path)
    trainer = target.trainer
    data = trainer.train_dataset
    if data is None:
        raise ValueError("fix 'drop-rows' filters trainer.train_dataset, and this trainer has none")
    if getattr(data, "nbguard_dropped_rows", None) == drop:
        return {}  # applied already: the indices now point at other rows
    rows = len(data)
    outside = [i for i in drop if not 0 <= i < rows]
    if outside:
        raise ValueError(f"fix 'drop-rows': indices {outside} are outside trainer.train_dataset ({rows} rows)")
    gone = set(drop)
    keep = [i for i in range(rows) if i not in gone]
    trainer.train_dataset = rows_kept(data, keep, "nbguard_dropped_rows", drop)  # (a second apply is a no-op)
    return {"trainer.train_dataset": f"{rows} -> {len(keep)} rows (dropped dataset indices {drop})"}


def _code(names: Names, indices: Any = None, path: str | None = None, **_: Any) -> str:
    t = names.trainer
    if indices is None and path is not None:
        source = (f"import json\n\nwith open({str(path)!r}) as _f:\n"
                  f"    _bad_rows = set(json.load(_f)[\"dataset_indices\"])  # written by nbguard")
    else:
        source = f"_bad_rows = {set(read_indices(indices)) or 'set()'}"
    return f"""# Rows a watch event named as breaking training (dataset indices of {t}.train_dataset): drop them.
{source}
_keep = [_i for _i in range(len({t}.train_dataset)) if _i not in _bad_rows]
if hasattr({t}.train_dataset, "select"):  # a datasets.Dataset
    {t}.train_dataset = {t}.train_dataset.select(_keep)
else:
    import torch

    {t}.train_dataset = torch.utils.data.Subset({t}.train_dataset, _keep)
"""


register(Fix("drop-rows", "Drop the rows that broke a step",
             "Filter the dataset indices a watch event named (evidence rows.dataset_indices) out of "
             "trainer.train_dataset.", _drop, _code, needs="trainer"))
