"""The Report: one document that holds a session's audit, watches, diagnoses and fixes, and
writes itself as self-contained HTML, Markdown for a GitHub issue, or versioned JSON.

Secrets are redacted when the report is built and again when it is written (the environment
may have changed in between), so nothing a report shows or saves carries them.
"""
from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

from ..document.codec import MAX_DOCUMENT_BYTES, load_document_text
from ..document.merge import as_document, check_document, gather, merge_documents
from ..document.outward import outward, outward_text
from ..document.view import lookup, view
from ..environment import environment_info
from ..findings import Displayable
from ..introspect.user_files import read_bytes
from ..render import encode_document, render_html, render_text
from ..render.charts import chart_png
from ..render.markdown import render_markdown
from ..session import SESSION

FORMATS = {".html": "html", ".htm": "html", ".md": "markdown", ".json": "json"}


class Report(Displayable):
    """A "report" document (see ``nbguard/reporting/schema.json``), redacted."""

    def __init__(self, doc: dict, *, redact_home: bool = True):
        self.redact_home = redact_home
        self._doc = outward(encode_document(check_document(doc, "doc")), home=redact_home)

    # -- data -------------------------------------------------------------------------------
    def to_document(self) -> dict:
        return copy.deepcopy(self._doc)

    def to_dict(self) -> dict:
        """The report as JSON-ready data (schema v1, redacted)."""
        return self._written()

    def _written(self) -> dict:
        return outward(self._doc, home=self.redact_home)  # again: secrets set since build are caught too

    @classmethod
    def from_dict(cls, data: dict, *, redact_home: bool = True) -> Report:
        return cls(check_document(data, "data"), redact_home=redact_home)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Report:
        """A report saved with ``save("....json")`` (or any saved v1 document)."""
        path = _as_path(path)
        # a saved report may come from anyone: read within the document limits (bytes, nesting, lists, grids),
        # never a FIFO, before json parses it
        try:
            data = load_document_text(read_bytes(str(path), limit=MAX_DOCUMENT_BYTES))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not a JSON nbguard report ({exc}); load the .json file that save() wrote") from None
        return cls.from_dict(data)

    # -- formats ----------------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps(self._written(), indent=2, ensure_ascii=False, allow_nan=False) + "\n"

    def to_html(self) -> str:
        """One self-contained page: CSS inline, heatmaps as data URIs, no external references."""
        return render_html(self._written(), standalone=True)

    def to_markdown(self, images: dict[str, str] | None = None) -> str:
        return render_markdown(self._written(), images=images)

    def save(self, path: str | os.PathLike) -> Path:
        """Write the report; the suffix picks the format (.html, .md or .json). Missing parent
        folders are created. For .md, heatmaps are written beside it as ``NAME.heatmap.png``."""
        path = _as_path(path)
        fmt = FORMATS.get(path.suffix.lower())
        if fmt is None:
            raise ValueError(f"cannot tell the report format from {path.name!r}: use a path ending in "
                             f"{', '.join(FORMATS)}")
        path.parent.mkdir(parents=True, exist_ok=True)
        if fmt == "html":
            path.write_text(self.to_html(), encoding="utf-8")
        elif fmt == "json":
            path.write_text(self.to_json(), encoding="utf-8")
        else:
            images = self._write_images(path)
            path.write_text(self.to_markdown(images), encoding="utf-8")
        return path

    def image_files(self, stem: str) -> dict[str, tuple[str, bytes]]:
        """The heatmap PNGs of this report: {"heatmap-1": (file name, png bytes), ...}."""
        doc = self._written()
        charts = [c for c in view(doc).file_charts() if not c.empty]
        totals = {kind: sum(c.kind == kind for c in charts) for kind in {c.kind for c in charts}}
        counters: dict[str, int] = {}
        out: dict[str, tuple[str, bytes]] = {}
        for chart in charts:
            number = counters[chart.kind] = counters.get(chart.kind, 0) + 1
            suffix = "" if totals[chart.kind] == 1 else f"-{number}"
            try:
                png = chart_png(chart.kind, lookup(doc, chart.source))
            except Exception:  # a picture that cannot be drawn is left out with a note
                continue
            if png is not None:
                out[f"{chart.kind}-{number}"] = (f"{stem}.{chart.kind}{suffix}.png", png)
        return out

    def _write_images(self, path: Path) -> dict[str, str]:
        names = {}
        for key, (name, png) in self.image_files(path.stem).items():
            (path.parent / name).write_bytes(png)
            names[key] = name
        return names

    # -- display ----------------------------------------------------------------------------
    def __repr__(self) -> str:
        doc = self._doc
        parts = [f"{len(gather(doc, name))} {label}" for name, label in (
            ("findings", "findings"), ("watches", "watches"), ("diagnoses", "diagnoses"),
            ("fixes_applied", "fixes applied"))]
        return outward_text(f"<nbguard Report: {', '.join(parts)}>")

    def __str__(self) -> str:
        return outward_text(render_text(self._written()))


def _as_path(path: Any) -> Path:
    try:
        return Path(os.fspath(path))
    except TypeError:
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}") from None


def build_report(audit: Any = None, watch: Any = None) -> Report:
    """A Report of ``audit`` and ``watch`` (one watch or a list), followed by the explained exceptions
    and applied fixes this session recorded. With neither, the session's whole story in order: every
    audit, watch, fix applied, explained exception and verification as it happened.

    ``audit``/``watch`` may be result objects (anything with ``to_document()``) or documents.
    """
    docs: list[dict] = []
    notes: list[str] = []
    if audit is None and watch is None:
        numbers: dict[str, int] = {}
        for entry in SESSION.timeline:
            numbers[entry.kind] = numbers.get(entry.kind, 0) + 1
            _collect(docs, notes, entry, f"the session's {entry.kind} {numbers[entry.kind]}", lambda e, _: e.document())
    else:
        if audit is not None:
            docs.append(_timed(audit, as_document(audit, "audit")))
        if watch is not None:
            watches = list(watch) if isinstance(watch, (list, tuple)) else [watch]
            for index, item in enumerate(watches):
                docs.append(_timed(item, as_document(item, "watch" if len(watches) == 1 else f"watch[{index}]")))
        for entry in SESSION.timeline:
            if entry.kind in ("diagnosis", "fix"):
                _collect(docs, notes, entry, f"the session's {entry.kind}", lambda e, _: e.document())
        docs = _in_time_order(docs)
    merged = merge_documents(docs, title="nbguard report", environment=environment_info())
    if notes:
        merged["notes"] = notes
    return Report(merged)


def _timed(obj: Any, doc: dict) -> dict:
    """``doc`` with the time the session recorded ``obj`` (its audit, its watch's first attach), when it did."""
    if "time" in doc:
        return doc
    when = next((e.time for e in SESSION.timeline if e.holds(obj)), None)
    return doc if when is None else {**doc, "time": when}


def _in_time_order(docs: list[dict]) -> list[dict]:
    """The documents as they happened (a fix applied before the watch comes before it); one with no time
    keeps its place after the one before it."""
    keyed, last = [], float("-inf")
    for index, doc in enumerate(docs):
        when = doc.get("time")
        last = float(when) if isinstance(when, (int, float)) and not isinstance(when, bool) else last
        keyed.append((last, index, doc))
    return [doc for _, _, doc in sorted(keyed, key=lambda item: (item[0], item[1]))]


def _collect(docs: list, notes: list, value: Any, label: str, convert) -> None:
    """Session records are gathered best-effort: one broken record becomes a note, not a crash."""
    try:
        docs.append(convert(value, label))
    except Exception as exc:
        notes.append(f"{label} could not be included: {exc!r}")
