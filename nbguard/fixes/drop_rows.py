"""drop-rows: filter the rows a watch event named (by dataset index) out of the Trainer's training data.

The watch names the rows of a bad step by the dataset indices its sampler drew
(``event.evidence["rows"]["dataset_indices"]``, :mod:`nbguard.watcher.localise.rows`); this fix drops exactly
those rows. ``indices=`` lists them, or ``path=`` reads them from the JSON file
``nbguard.watcher.localise.rows.save_rows`` wrote (its ``dataset_indices``).
"""
from __future__ import annotations

import inspect
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
                         "JSON file nbguard.watcher.localise.rows.save_rows wrote)")
    if not isinstance(indices, (list, tuple, set)) or not all(isinstance(i, int) and not isinstance(i, bool)
                                                                for i in indices):
        raise ValueError(f"fix 'drop-rows': indices must be a list of dataset indices (ints), got {indices!r}")
    return sorted(set(indices))


# The cells carry these functions' own source: no annotations, no names from this module.
def rows_kept(data, keep, mark, value):
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


def without_rows(data, drop):
    """``data`` without the rows at the dataset indices ``drop`` (a sorted list). Marked with them, so dropping
    the same indices again leaves it as it is: by then they would name other rows."""
    if getattr(data, "nbguard_dropped_rows", None) == drop:
        return data
    gone = set(drop)
    return rows_kept(data, [i for i in range(len(data)) if i not in gone], "nbguard_dropped_rows", drop)


def _drop(target: Target, indices: Any = None, path: str | None = None, **_: Any) -> dict:
    drop = read_indices(indices, path)
    trainer = target.trainer
    data = trainer.train_dataset
    if data is None:
        raise ValueError("fix 'drop-rows' filters trainer.train_dataset, and this trainer has none")
    if getattr(data, "nbguard_dropped_rows", None) == drop:
        return {}  # applied already (or its cell ran): the indices now point at other rows
    rows = len(data)
    outside = [i for i in drop if not 0 <= i < rows]
    if outside:
        raise ValueError(f"fix 'drop-rows': indices {outside} are outside trainer.train_dataset ({rows} rows)")
    trainer.train_dataset = without_rows(data, drop)
    return {"trainer.train_dataset": f"{rows} -> {len(trainer.train_dataset)} rows (dropped dataset indices {drop})"}


def _code(names: Names, indices: Any = None, path: str | None = None, **_: Any) -> str:
    t = names.trainer
    if indices is None and path is not None:
        source = (f"import json\n\nwith open({str(path)!r}) as _f:\n"
                  f"    _bad_rows = set(json.load(_f)[\"dataset_indices\"])  # written by nbguard")
    else:
        source = f"_bad_rows = {set(read_indices(indices)) or 'set()'}"
    return f"""import torch

# Rows a watch event named as breaking training (dataset indices of {t}.train_dataset): drop them. What is
# left is marked with the indices dropped, so running this again drops nothing more.
{inspect.getsource(rows_kept)}

{inspect.getsource(without_rows)}

{source}
{t}.train_dataset = without_rows({t}.train_dataset, sorted(_bad_rows))
"""

register(Fix("drop-rows", "Drop the rows that broke a step",
             "Filter the dataset indices a watch event named (evidence rows.dataset_indices) out of "
             "trainer.train_dataset.", _drop, _code, needs="trainer"))
