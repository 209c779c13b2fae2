"""What this kernel session recorded, in order: the timeline behind ``nbguard.report()``.

Every audit, watch, explained exception, applied fix and verification becomes one
:class:`TimelineEntry` (``kind``, ``time``, ``document()``), so a report can tell the story as it
happened: the error, then the fix, then the run after the fix.

The timeline holds no strong reference to what the user trains. A watch entry keeps its watch
only through a weak reference (while attached, the model's own hooks keep the watch alive) and
takes a document snapshot when the watch detaches or is collected; everything else is stored as
plain data (documents and dicts). So ``del model, trainer; gc.collect()`` frees the memory.
Each producer calls ``record_*``; nothing here imports torch.
"""
from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field
from typing import Any

from .document import document
from .document.view import Verdict, fix_verdicts

KINDS = ("audit", "watch", "fix", "diagnosis", "verification")


class Snapshot(dict):
    """A recorded document standing in for an object that is gone: a dict, with ``to_document()``
    like the result object it replaces, so code that asked a watch for its document keeps working."""

    def to_document(self) -> dict[str, Any]:
        return dict(self)


def _document_of(value: Any) -> dict[str, Any]:
    """A v1 document from a result object (``to_document()``) or a document dict."""
    if isinstance(value, dict):
        return value
    return value.to_document()


@dataclass(eq=False)
class TimelineEntry:
    """One moment of the session. ``document()`` describes it as a v1 document."""

    kind: str
    time: float
    _snapshot: dict[str, Any] | None = None  # plain data taken when the entry was recorded or released
    _held: Any = None  # a strong reference, only to plain data objects (audit/diagnosis results, records)
    _ref: weakref.ref | None = field(default=None, repr=False)  # a watch (or any user-facing object) weakly
    _id: int | None = None  # id() of the weakly held object: a finalizer runs after its weakrefs are cleared

    @property
    def value(self) -> Any:
        """The recorded object while it is still alive, else its document snapshot."""
        if self._held is not None:
            return self._held
        live = self._ref() if self._ref is not None else None
        return live if live is not None else self._snapshot

    def live(self) -> Any:
        """The recorded object if it is still reachable; None once only its snapshot is left."""
        if self._held is not None:
            return self._held
        return self._ref() if self._ref is not None else None

    def document(self) -> dict[str, Any]:
        """The v1 document of this moment (fresh from a live watch, else the snapshot), with its ``time``."""
        return {**self._document(), "time": self.time}

    def _document(self) -> dict[str, Any]:
        if self.kind == "watch":
            live = self.live()
            if live is not None:
                return _document_of(live)
        if self.kind == "fix":
            return document("fix", fixes_applied=[dict(self._held)])
        if self._snapshot is not None:
            return self._snapshot
        if self.kind == "diagnosis" and not hasattr(self._held, "to_document"):
            return document("diagnosis", diagnoses=[self._held.to_dict()])  # raises for a broken record
        return _document_of(self._held)

    def holds(self, obj: Any) -> bool:
        """True when this entry records ``obj`` (also from ``obj``'s finalizer, when the weakref is dead)."""
        if self._ref is None:
            return self._held is obj
        live = self._ref()
        return live is obj if live is not None else self._id == id(obj)

    def release(self, obj: Any) -> None:
        """Snapshot ``obj``'s document (a watch detaching or being collected)."""
        try:
            self._snapshot = Snapshot(_document_of(obj))
        except Exception:  # a broken record keeps its last snapshot; the report notes it
            pass


@dataclass
class SessionRecord:
    timeline: list[TimelineEntry] = field(default_factory=list)
    # The hardware the user named to an audit (None: none named, the detected machine is the target):
    # the watch verifies what that target would run, so a verdict speaks of the cell the user will run.
    target_hardware: Any = None
    # The user's variable names for fix cells ({"trainer": "trainer"}), as the notebook last resolved
    # them: verified cells and applied cells are rendered with the same names, so their texts compare.
    names: dict[str, str] = field(default_factory=dict)

    # -- the timeline -------------------------------------------------------------------------
    def entries(self, kind: str) -> list[TimelineEntry]:
        return [e for e in self.timeline if e.kind == kind]

    def documents(self) -> list[dict[str, Any]]:
        """Every entry's document, in the order things happened.

        An entry whose document cannot be built becomes a document of the same kind carrying a
        ``notes`` line, so one broken record never hides the rest of the story.
        """
        docs = []
        counts: dict[str, int] = {}
        for entry in self.timeline:
            counts[entry.kind] = counts.get(entry.kind, 0) + 1
            try:
                docs.append(entry.document())
            except Exception as exc:
                docs.append(document(entry.kind, time=entry.time, notes=[
                    f"the session's {entry.kind} {counts[entry.kind]} could not be included: {exc!r}"]))
        return docs

    def clear(self) -> None:
        self.timeline.clear()
        self.target_hardware = None
        self.names = {}

    def fix_names(self, target: str) -> dict[str, str]:
        """The names a fix cell for ``target`` ("trainer" or "model") is written with: the user's, as
        the notebook knows them, else the usual variable name."""
        loop = ("optimizer", "scaler") if target == "model" else ()  # a plain loop's cells name its optimizer
        known = {k: v for k, v in self.names.items() if k in (target, "args", "tokenizer", *loop)}
        return {target: target, **known}

    # -- the earlier list API, derived from the timeline (reporting still reads these) ----------
    @property
    def audits(self) -> list[Any]:
        return [e.value for e in self.entries("audit")]

    @property
    def last_audit(self) -> Any:
        audits = self.entries("audit")
        return audits[-1].value if audits else None

    @property
    def watches(self) -> list[Any]:
        """Each watch while it is alive, else the document it left."""
        return [e.value for e in self.entries("watch")]

    @property
    def diagnoses(self) -> list[Any]:
        return [e.value for e in self.entries("diagnosis")]

    @property
    def fixes_applied(self) -> list[dict[str, Any]]:
        return [e.value for e in self.entries("fix")]

    @property
    def verifications(self) -> list[dict[str, Any]]:
        return [e.document() for e in self.entries("verification")]

    def _add(self, entry: TimelineEntry) -> TimelineEntry:
        self.timeline.append(entry)
        return entry


SESSION = SessionRecord()


def _snapshot_or_none(value: Any) -> dict[str, Any] | None:
    try:
        return Snapshot(_document_of(value))
    except Exception:  # kept as the object: the report turns it into a note
        return None


def record_audit(result: Any) -> None:
    """An audit: its document now (plain data); the result object itself only weakly."""
    snapshot = _snapshot_or_none(result)
    entry = TimelineEntry("audit", time.time(), _snapshot=snapshot)
    if isinstance(result, dict):
        entry._held = result
    elif snapshot is None:
        entry._held = result  # could not be turned into data: kept so the report can say why
    else:
        try:
            entry._ref = weakref.ref(result)
        except TypeError:
            pass  # not weak-referenceable: the snapshot stands for it
    SESSION._add(entry)


def record_watch(watch: Any) -> None:
    """A watch, on every attach; the same watch keeps its one entry (its first attach's place)."""
    for entry in SESSION.entries("watch"):
        if entry.live() is watch:
            return
    try:
        ref = weakref.ref(watch)
    except TypeError:
        SESSION._add(TimelineEntry("watch", time.time(), _held=watch))
        return
    if hasattr(watch, "attached"):  # a real watch: only weakly, with a snapshot when it goes away
        SESSION._add(TimelineEntry("watch", time.time(), _ref=ref, _id=id(watch)))
    else:  # any other object with to_document(): nothing of the user's behind it, keep it
        SESSION._add(TimelineEntry("watch", time.time(), _held=watch))


def release_watch(watch: Any) -> None:
    """Called by a watch when it detaches or is collected: keep its document, not the watch."""
    for entry in reversed(SESSION.entries("watch")):
        if entry._ref is not None and entry.holds(watch):
            entry.release(watch)
            return


def record_diagnosis(diagnosis: Any) -> None:
    """A diagnosis is plain data (it keeps the exception only as text): stored as it is."""
    SESSION._add(TimelineEntry("diagnosis", time.time(), _snapshot=_snapshot_or_none(diagnosis), _held=diagnosis))


def record_fix(fix_id: str, changed: Any, code: str) -> None:
    """An applied fix; ``code`` is the cell with the user's own variable names."""
    now = time.time()
    record = {"fix": fix_id, "changed": changed, "code": code, "time": now}
    SESSION._add(TimelineEntry("fix", now, _held=record))


def record_verification(verification: Any) -> None:
    """A verification (anything with ``to_document()``), stored as its document."""
    snapshot = Snapshot(_document_of(verification))
    SESSION._add(TimelineEntry("verification", time.time(), _snapshot=snapshot))


def latest_verdict(fix_id: str, code: str) -> Verdict | None:
    """The most recent verdict this session holds for exactly this cell of ``fix_id`` (from a watch's,
    an audit's or a diagnosis' verification), or None when that cell never ran on a failing step: a
    verdict never travels to another variant of the fix (other options, other names)."""
    for doc in reversed(SESSION.documents()):
        found = fix_verdicts(doc).get((fix_id, code))
        if found is not None:
            return found
    return None


def verified_variants(fix_id: str) -> list[str]:
    """The cells of ``fix_id`` this session verified, newest first (to say which one ran when another did not)."""
    cells = [code for doc in reversed(SESSION.documents()) for (fid, code), v in fix_verdicts(doc).items()
             if fid == fix_id and v.status == "verified"]
    return list(dict.fromkeys(cells))
