"""Which rows broke the step: dataset indices recorded as the loader draws them, and each row's loss
on the failing step.

Recording costs nothing measurable: the sampler inside the loader's batch sampler (the Trainer's
``SeedableRandomSampler``/``RandomSampler``, a plain ``DataLoader``'s sampler over a map-style
dataset) is wrapped so each index it yields is appended to a queue; every captured training
micro-batch takes as many indices off the front as it has rows. Indices are drawn in the main
process even with worker processes, and in the order the batches arrive, so prefetching does not
misalign them. Where the loader is not known, rows are named by micro-batch and position; so they
are where a named row's tokens are not ``dataset[index]``'s (a collator that packs or drops rows):
an index is never given for a row it may not be.

On a bad step (:func:`.row_replay.row_losses`) the step's micro-batches are run once more, without gradients,
with the RNG and autocast they were captured with: each row's loss is the token loss with
``reduction="none"`` averaged over its supervised tokens. Rows whose loss is not finite are the ones
that broke it; where every row is finite, the highest losses are listed as suspects.
"""
from __future__ import annotations

import json
import math
import re
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ...document.outward import outward, outward_text
from ...findings import Event
from ...introspect.tokenizers import tokenizer_of
from ...step.capture import MicroBatch
from ..core.guard import OnError, warn_failure
from ..core.pipeline import Detector
from ..integrations.instance_wrap import InstanceWrap
from .row_grads import row_grad_shares
from .row_replay import row_losses

MOST_ROWS = 8  # rows listed in an event
EXCERPT_CHARS = 120  # a named row's decoded excerpt (redacted whole, then cut): what a glance needs, no more
DOMINANT_SHARE = 0.5  # a row pulling this share of an exploded step's gradient norm is named for drop-rows


class RecordingSampler:
    """A sampler that yields what the wrapped one yields and appends each index to ``queue``."""

    def __init__(self, sampler: Any, queue: deque):
        self.nbguard_wrapped = sampler
        self._queue = queue

    def __iter__(self) -> Iterator[Any]:
        append = self._queue.append
        for index in self.nbguard_wrapped:
            append(index)
            yield index

    def __len__(self) -> int:
        return len(self.nbguard_wrapped)

    def __getattr__(self, name: str) -> Any:  # set_epoch, generator, data_source...: the wrapped sampler's
        if name in ("nbguard_wrapped", "_queue"):
            raise AttributeError(name)
        return getattr(self.nbguard_wrapped, name)


def micro_batch_rows(mb: MicroBatch) -> int | None:
    """How many rows the micro-batch has (its first batched tensor's first dimension)."""
    for value in (mb.kwargs.get("input_ids"), mb.labels(), *mb.args, *mb.kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() >= 1:
            return int(value.shape[0])
    return None


class RowTracker(Detector):
    """Dataset indices per captured micro-batch (a detector: it only listens to captures)."""

    name = "row-tracker"

    def __init__(self) -> None:
        self.queue: deque = deque()
        self.step_rows: dict[int, list[Any] | None] = {}  # micro-batch index -> its dataset indices
        self.loaders: list[tuple[Any, RecordingSampler, Any]] = []  # (batch sampler, wrapper, original)
        self._tap: InstanceWrap | None = None
        # the micro-batches stopped matching the indices drawn (a collator that packs or drops rows): from
        # then on rows are named by position only, never by an index that may be another row's
        self.misaligned = False
        self.slack = 64
        self.dataset: Any = None
        self.tokenizer: Any = None  # decodes a named row's excerpt (the Trainer's processing class, or given)

    # ---- where the indices come from ----------------------------------------------------------------
    def follow(self, loader: Any) -> bool:
        """Record the indices ``loader`` (a DataLoader over a map-style dataset) draws; False where it has
        no sampler to wrap (an iterable dataset, ``batch_size=None``)."""
        batch_sampler = getattr(loader, "batch_sampler", None)
        sampler = getattr(batch_sampler, "sampler", None)
        if batch_sampler is None or sampler is None:
            return False
        if isinstance(sampler, RecordingSampler):
            if sampler._queue is self.queue:
                return True
            sampler = sampler.nbguard_wrapped  # another watch's: take it over
        wrapper = RecordingSampler(sampler, self.queue)
        batch_sampler.sampler = wrapper
        self.loaders.append((batch_sampler, wrapper, sampler))
        self.dataset = getattr(loader, "dataset", None)  # to check a named row against (see ``matches``)
        self.queue.clear()  # a new loader: whatever an older one drew ahead will not be trained on
        self.misaligned = False
        # the most indices the loader can draw ahead of the forwards: its prefetched batches, and a few more
        workers = getattr(loader, "num_workers", 0) or 0
        ahead = workers * (getattr(loader, "prefetch_factor", None) or 2) + 4
        self.slack = ahead * max(int(getattr(batch_sampler, "batch_size", 1) or 1), 1)
        return True

    # ---- the watch's lifecycle points (a component from the first loader it follows, or a Trainer) ------
    def attach(self, context: Any) -> None:
        if context.trainer is not None:
            self.bind_trainer(context.trainer, context.fail)

    def detach(self) -> None:
        self.unbind()

    def bind_trainer(self, trainer: Any, on_error: OnError = warn_failure) -> None:
        """Follow every train dataloader the Trainer builds (inside ``train()``); a failure of nbguard's
        part is ``on_error``'s (the watch's internal error), the loader is the user's either way."""
        self.tokenizer = tokenizer_of(trainer)
        def get_train_dataloader(original, *args, **kwargs):
            loader = original(*args, **kwargs)
            try:
                self.follow(loader)
            except Exception:  # rows stay unnamed by index; never the user's run
                pass
            return loader

        self._tap = InstanceWrap(trainer, "get_train_dataloader", get_train_dataloader, on_error)

    def unbind(self) -> None:
        if self._tap is not None:
            self._tap.remove()
            self._tap = None
        for batch_sampler, wrapper, original in self.loaders:
            if getattr(batch_sampler, "sampler", None) is wrapper:
                batch_sampler.sampler = original
        self.loaders = []
        self.queue.clear()

    # ---- per step ----------------------------------------------------------------------------------
    def on_micro_batch(self, micro_batch: MicroBatch) -> None:
        if not self.loaders or self.misaligned:
            return
        rows = micro_batch_rows(micro_batch)
        if rows is None:
            return
        if len(self.queue) < rows:  # fewer drawn than trained on: these rows did not come from the sampler
            self._lose_alignment()
            return
        self.step_rows[micro_batch.index] = [self.queue.popleft() for _ in range(rows)]
        if len(self.queue) > self.slack:  # far more drawn than trained on: rows are packed or dropped
            self.step_rows[micro_batch.index] = None
            self._lose_alignment()

    def _lose_alignment(self) -> None:
        self.misaligned = True
        self.queue.clear()

    def reset_step(self) -> None:
        self.step_rows = {}

    def indices(self, micro_batch: int) -> list[Any] | None:
        return self.step_rows.get(micro_batch)

    def matches(self, index: Any, mb: MicroBatch, row: int) -> bool:
        """Whether row ``row`` of ``mb`` holds the tokens of ``dataset[index]`` (padded on either side);
        True where nothing can be compared (no dataset, no ``input_ids``). Read on a bad step only."""
        ids = mb.kwargs.get("input_ids")
        if ids is None and mb.args and isinstance(mb.args[0], torch.Tensor):
            ids = mb.args[0]
        if self.dataset is None or not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            return True
        try:
            item = self.dataset[index]
            expected = torch.as_tensor(item["input_ids"]).reshape(-1).to(ids.device)
        except Exception:  # not a mapping with input_ids (or not indexable): nothing to compare
            return True
        got, n = ids[row], expected.numel()
        if n > got.numel():
            return False
        return bool(torch.equal(got[:n], expected)) or bool(torch.equal(got[got.numel() - n:], expected))


def name_rows(event: Event, model: torch.nn.Module, micro_batches: list[MicroBatch],
              tracker: RowTracker | None) -> None:
    """Put the rows that broke ``event``'s step into its evidence and message."""
    rows = row_losses(model, micro_batches)
    if not rows:
        return
    for row in rows:
        indices = tracker.indices(row["micro_batch"]) if tracker is not None else None
        row["dataset_index"] = _plain(indices[row["row"]]) if indices is not None and row["row"] < len(indices) \
            else None
    bad = [r for r in rows if not math.isfinite(r["loss"])]
    shares_unknown = None
    if not bad:  # every row finite (an explosion): the rows that pulled the update most are the suspects
        try:
            shares, shares_unknown = row_grad_shares(model, micro_batches)
        except Exception as exc:  # (a backward per row the model cannot give, e.g. reentrant checkpointing):
            shares, shares_unknown = {}, f"{type(exc).__name__}: {exc}"  # the rows stay named by their losses
        for row in rows:
            row["grad_share"] = shares.get((row["micro_batch"], row["row"]))
    suspects = bad or sorted(rows, key=lambda r: (-(r.get("grad_share") or 0.0), -r["loss"]))[:3]
    by_index = {mb.index: mb for mb in micro_batches}
    for row in suspects:  # an index is named only if that dataset row holds the tokens trained on
        if row["dataset_index"] is not None and tracker is not None \
                and not tracker.matches(row["dataset_index"], by_index[row["micro_batch"]], row["row"]):
            tracker.misaligned = True
    if tracker is not None and tracker.misaligned:
        for row in rows:
            row["dataset_index"] = None
    evidence: dict[str, Any] = {"nonfinite": bool(bad), "rows": suspects[:MOST_ROWS], "rows_checked": len(rows)}
    if shares_unknown is not None:
        evidence["grad_shares_unknown"] = shares_unknown
    if tracker is not None and tracker.misaligned:
        evidence["dataset_indices_unknown"] = ("the training micro-batches do not match the rows the sampler drew "
                                               "(a collator that packs or drops rows, batches from elsewhere): rows "
                                               "are named by position")
    indices = [r["dataset_index"] for r in suspects if r["dataset_index"] is not None]
    if bad and len(indices) == len(bad):
        evidence["dataset_indices"] = indices
        evidence["fix"] = "drop-rows"
    elif not bad and suspects and (suspects[0].get("grad_share") or 0.0) >= DOMINANT_SHARE \
            and suspects[0]["dataset_index"] is not None:  # one row pulled most of an exploded step
        evidence["dataset_indices"] = [suspects[0]["dataset_index"]]
        evidence["fix"] = "drop-rows"
    tokenizer = tracker.tokenizer if tracker is not None else None
    if tokenizer is not None:
        for row in suspects[:MOST_ROWS]:
            text = row_excerpt(tokenizer, by_index[row["micro_batch"]], row["row"])
            if text is not None:
                row["excerpt"] = text
    event.evidence["rows"] = evidence
    if bad:
        event.message += f"; {len(bad)} of {len(rows)} rows have a non-finite loss: " + ", ".join(
            _row_text(r) for r in bad[:MOST_ROWS]) + ("" if len(bad) <= MOST_ROWS else ", ...")
    elif suspects and suspects[0].get("grad_share") is not None:
        top = suspects[0]
        event.message += (f"; {_row_text(top)} pulled {top['grad_share']:.0%} of the gradient norm over the step's "
                          f"{len(rows)} rows (loss {top['loss']:.4g})")


def row_excerpt(tokenizer: Any, mb: MicroBatch, row: int) -> str | None:
    """The row decoded whole (its padding left out), redacted, then cut to EXCERPT_CHARS; None where it
    cannot be decoded (no input_ids, a processor without decode).

    Redacted before it is cut, so a secret that straddles the cut has no prefix left. A WordPiece
    tokenizer decodes ``hf_abc…`` as ``hf _ abc…`` (a space on each side of punctuation), which has no
    secret's shape: the text with those spaces closed is redacted too, and is the excerpt when it held one."""
    ids = mb.kwargs.get("input_ids")
    decode = getattr(tokenizer, "decode", None) or getattr(getattr(tokenizer, "tokenizer", None), "decode", None)
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or row >= ids.shape[0] or decode is None:
        return None
    tokens = ids[row]
    mask = mb.kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.shape == ids.shape:
        tokens = tokens[mask[row].bool()]
    try:
        text = str(decode(tokens.tolist(), skip_special_tokens=False))
    except Exception:  # a tokenizer that cannot decode these ids: the row stays named without its text
        return None
    return excerpt_of(text)


_SPACED_PUNCTUATION = re.compile(r"\s*([!-/:-@\[-`{-~])\s*")  # ASCII punctuation and the spaces around it


def excerpt_of(text: str) -> str:
    """A decoded row's text as an excerpt: whitespace runs as one space, redacted whole, then cut."""
    text = " ".join(text.split())
    closed = _SPACED_PUNCTUATION.sub(r"\1", text)  # "hf _ abc" -> "hf_abc": WordPiece's spacing undone
    shown = outward_text(closed)
    if shown == closed:  # no secret there: the text as decoded
        shown = outward_text(text)
    return shown if len(shown) <= EXCERPT_CHARS else shown[:EXCERPT_CHARS - 3] + "..."


def excerpt_quote(excerpt: str) -> str:
    """How an excerpt is quoted after a row's name in an event's message."""
    return f' ("{excerpt[:60]}{"..." if len(excerpt) > 60 and not excerpt.endswith("...") else ""}")'


def _row_text(row: dict[str, Any]) -> str:
    where = f"dataset index {row['dataset_index']}" if row.get("dataset_index") is not None else \
        f"micro-batch {row['micro_batch']} row {row['row']}"
    excerpt = row.get("excerpt")
    if excerpt:
        where += excerpt_quote(excerpt)
    return where


def without_row_text(data: Any) -> Any:
    """A copy of ``data`` (an event's or a document's JSON-like data) without the rows' excerpts: each
    named row's ``excerpt`` dropped, and its quote taken out of every message that carries it. What goes
    to a tracker or a published report by default: a row's text is the user's data."""
    quotes: list[str] = []

    def collect(value: Any) -> None:
        if isinstance(value, dict):
            if isinstance(value.get("excerpt"), str) and "micro_batch" in value:
                quotes.append(excerpt_quote(value["excerpt"]))
            for item in value.values():
                collect(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                collect(item)

    def strip(value: Any) -> Any:
        if isinstance(value, str):
            for quote in quotes:
                value = value.replace(quote, "")
            return value
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if not (k == "excerpt" and "micro_batch" in value)}
        if isinstance(value, (list, tuple)):
            return [strip(v) for v in value]
        return value

    collect(data)
    quotes.sort(key=len, reverse=True)
    return strip(data) if quotes else data


def _plain(index: Any) -> Any:
    return int(index) if isinstance(index, (int, torch.Tensor)) or hasattr(index, "__index__") else index


def bad_row_indices(event: Event) -> list[Any]:
    """The dataset indices of the rows that broke ``event``'s step (empty where none were named)."""
    return list((event.evidence.get("rows") or {}).get("dataset_indices") or [])


def save_rows(event: Event, path: str | Path) -> Path:
    """Write the rows ``event`` names as JSON: ``{"step", "kind", "dataset_indices", "rows"}``."""
    rows = event.evidence.get("rows") or {}
    data = {"step": event.step, "kind": event.kind, "dataset_indices": bad_row_indices(event),
            "rows": [{**r, "loss": r["loss"] if math.isfinite(r["loss"]) else str(r["loss"])}
                     for r in rows.get("rows", [])]}
    out = Path(path)
    out.write_text(json.dumps(outward(data), indent=1) + "\n", encoding="utf-8")
    return out
