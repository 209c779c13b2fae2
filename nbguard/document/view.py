"""The presentation model: what every renderer shows of a document, computed once.

``view(doc)`` decides the section order, the severity order, the counts, the history overview,
the probe's headroom rows, the palette and the spelling of every number ("NaN", "Inf", "1.5e+05",
"—" for missing). Text, static HTML, Markdown, the ipywidgets cards and the JupyterLab renderer
only lay the result out (``View.to_dict()`` is what the Lab extension receives), so they cannot
drift apart: a value the HTML shows, the Lab view shows with the same words.

Documents come from many producers and from saved notebooks, so nothing here trusts the shape:
missing sections are skipped and odd values are shown as text; a section that cannot be viewed
becomes a note instead of hiding the rest.
"""
from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from .codec import as_float, pretty_json
from .model import fold_skip_streaks
from .palette import palette

SEVERITY_ORDER = ("error", "warning", "info")
KEY_PACKAGES = ("torch", "transformers", "peft", "accelerate", "trl", "bitsandbytes", "unsloth")
MAX_PROBE_ROWS = 40
MAX_EVENTS = 100
SERIES_ALT = "loss, total grad norm and loss scale per step"
UPDATES_ALT = "update-norm heatmap (‖Δw‖ / ‖w‖ per step)"
MISSING = "—"


# -- number spelling ---------------------------------------------------------------------------
def fmt_num(value: Any, digits: int = 4) -> str:
    """A compact, human form of a number that may be non-finite or missing."""
    number = as_float(value)
    if number is None:
        return MISSING if value is None else str(value)
    if math.isnan(number):
        return "NaN"
    if math.isinf(number):
        return "Inf" if number > 0 else "-Inf"
    if number == int(number) and abs(number) < 1e15:
        return str(int(number))
    return f"{number:.{digits}g}"


def format_time(value: Any) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(value)))
    except (TypeError, ValueError, OverflowError, OSError):
        return str(value or "")


def fmt_bytes(value: Any) -> str:
    """A size for people: 1.3 GB, 912 MB, 48 KB (binary units, as the GPU's memory is quoted)."""
    number = as_float(value)
    if number is None:
        return MISSING
    for unit, size in (("GB", 2 ** 30), ("MB", 2 ** 20), ("KB", 2 ** 10)):
        if abs(number) >= size:
            return f"{fmt_num(number / size, 3)} {unit}"
    return f"{int(number)} bytes"


def _training_bytes(estimate: dict) -> float:
    """Weights + gradients + optimizer state: what the memory line says it counts (no reserve)."""
    return sum(as_float(estimate.get(k)) or 0.0 for k in ("weights_bytes", "grads_bytes", "optimizer_bytes"))


def plural(count: int, word: str, suffix: str = "s") -> str:
    return f"{count} {word}{'' if count == 1 else suffix}"


def last_line(text: Any) -> str:
    """The last non-empty line of an exception text: the error message itself."""
    rows = [row for row in str(text).splitlines() if row.strip()]
    return rows[-1].strip() if rows else ""


def short_json(value: Any, limit: int = 160) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def heading(doc: dict) -> str:
    """The document's heading: its own title (they already say "nbguard ..."), else its kind."""
    title = doc.get("title")
    return str(title) if title else f"nbguard {doc.get('kind', 'document')}"


# -- the model ---------------------------------------------------------------------------------
@dataclass
class Fact:
    """One statement of a summary list; ``tone`` is "bad", "skip", "good" or "" (plain)."""

    text: str
    tone: str = ""


@dataclass
class Table:
    columns: list[str]
    rows: list[list[str]]
    numeric: list[bool] = field(default_factory=list)  # per column: right-aligned figures
    code: list[bool] = field(default_factory=list)  # per column: names shown as code
    bad_rows: list[int] = field(default_factory=list)
    note: str = ""  # "12 more modules ..."


@dataclass
class Fold:
    """Details a reader opens on demand: JSON evidence, an exception text, what a fix changed."""

    label: str
    text: str
    short: str = ""  # one line, for the text renderer
    kind: str = "json"  # "json", "text" or "code"
    table: Table | None = None  # evidence as rows of name and value; ``text`` holds the same, aligned


REAUDITED = "re-audited on the trainer as built"  # how a re-audit verdict's reason starts (verifier/reaudit.py)


@dataclass
class Verdict:
    """Whether a fix was shown to work on the failing step (nbguard.verify), or by a re-audit of the trainer."""

    status: str  # "verified", "not-enough", "not-checked"
    label: str  # "verified", "not enough", "not checked"
    detail: str = ""

    @property
    def where(self) -> str:
        """What the verdict was reached on: a data or config fix's re-audit ran no training step."""
        return "by a re-audit of the trainer as built (no step)" if self.detail.startswith(REAUDITED) \
            else "on the failing step"


@dataclass
class FixView:
    id: str
    title: str = ""
    code: str = ""
    verdict: Verdict | None = None


@dataclass
class Card:
    tone: str  # "error", "warning" or "info": the left border and the badge
    title: str
    badge: str = ""  # "ERROR", or "" for no badge
    tag: str = ""  # the rule id, signature or event kind
    lines: list[str] = field(default_factory=list)
    quote: str = ""  # the one line that matters (an exception's message)
    table: Table | None = None
    folds: list[Fold] = field(default_factory=list)
    fixes: list[FixView] = field(default_factory=list)
    code: str = ""  # a fix applied: the cell that was run


@dataclass
class Chart:
    """A picture drawn from the document: ``source`` is the path of its section in the document
    (e.g. ["watches", 0, "history"]); ``empty`` says why there is nothing to draw."""

    kind: str  # "heatmap", "updates", "series" or "activations"
    alt: str
    source: list[Any]
    empty: str = ""


@dataclass
class Section:
    kind: str
    title: str = ""
    facts: list[Fact] = field(default_factory=list)
    cards: list[Card] = field(default_factory=list)
    table: Table | None = None
    charts: list[Chart] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    folded: bool = False  # shown closed by default (the environment)
    empty: str = ""  # what to say when the section has nothing ("No findings: nothing to fix.")
    cards_title: str = ""  # a heading over the cards ("Events (3)")


@dataclass
class View:
    title: str
    meta: str
    summary: str
    sections: list[Section]
    palette: dict[str, Any] = field(default_factory=palette)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def section(self, kind: str) -> Section | None:
        return next((s for s in self.sections if s.kind == kind), None)

    def file_charts(self) -> list[Chart]:
        """The charts saved as files beside a Markdown report, in view order: the story's heatmap is a
        first-screen copy of its watch's own, so it is not saved twice."""
        return [c for s in self.sections if s.kind != "story" for c in s.charts]


# -- building it ---------------------------------------------------------------------------------
def view(doc: dict) -> View:
    """The presentation model of ``doc`` (any v1 document: an audit, a watch, a report, ...)."""
    if not isinstance(doc, dict):
        raise TypeError(f"doc must be an nbguard document (dict), got {type(doc).__name__}")
    meta = f"nbguard {doc.get('nbguard_version', '?')} · schema v{doc.get('schema_version', '?')}"
    top = _sections(doc, [])
    sections = [*_story(doc), *(s for s in top if s.kind != "environment")]
    for number, entry in enumerate(_entries(doc), start=1):
        sections.append(Section(kind="entry", title=_entry_title(number, entry)))
        sections.extend(_sections(entry, ["entries", number - 1]))
    sections += [s for s in top if s.kind == "environment"]  # the reference details close the story
    return View(title=heading(doc), meta=meta, summary=_summary(doc), sections=sections)


# watch events that break a run: the first of them leads the story (a gradient explosion before a NaN
# is where the run broke, and its fix is the learning rate, not the NaN's module)
BROKE_THE_RUN = ("nonfinite-loss", "nonfinite-grad", "divergence")


@dataclass
class _Lead:
    """What leads a document's story: the card whose fixes it offers, what went wrong and where."""

    card: Card
    what: str
    where: str
    bad: bool  # an event that broke the run, or an audit error
    charts: list[Chart]


def _lead(doc: dict) -> _Lead | None:
    """The first watch event that broke the run (``BROKE_THE_RUN``), else the first event, else the latest
    audit's worst finding; None when nothing went wrong."""
    docs = [(doc, []), *((entry, ["entries", i]) for i, entry in enumerate(_entries(doc)))]
    watched = [(d, [*at, *w["path"]], w, e) for d, at in docs for w in watch_sections(d)
               for e in w["events"] if isinstance(e, dict)]
    watched.sort(key=lambda dwe: dwe[3].get("kind") not in BROKE_THE_RUN)
    charts = []
    if watched:  # the run's heatmap beside the story: healthy steps, then the turn
        _, at, watch, _ = watched[0]
        overview = history_overview(watch["history"])
        if overview.get("n_steps") and overview.get("n_groups"):
            charts.append(Chart("heatmap", "gradient-norm heatmap of the run that failed", [*at, "history"],
                                empty=_all_nonfinite(overview, "gradient norm")))
    if watched:
        owner, _, _, event = watched[0]
        card = event_card(event, fix_cells(owner), fix_verdicts(owner))
        kind = str(event.get("kind", "")).replace("-", " ").replace("nonfinite", "non-finite")
        what = f"step {event.get('step')}: {kind}" + (f" ({event['cause']})" if event.get("cause") else "")
        origins = [o for o in event.get("origins") or [] if isinstance(o, dict)]
        jumps = [g for g in (event.get("evidence") or {}).get("exploded_groups") or [] if isinstance(g, dict)]
        where = (f"{origins[0].get('module')} ({origins[0].get('phase')}"
                 + (f", {origins[0].get('dtype')}" if origins[0].get("dtype") else "") + ")") if origins else (
            f"no module: {event['cause']}" if event.get("cause") else
            f"{jumps[0].get('group')} (its gradient norm jumped most)" if jumps else "not localised to a module")
        return _Lead(card, what, where, event.get("kind") in BROKE_THE_RUN, charts)
    audits = [d for d, _ in docs if isinstance(d.get("findings"), list)]
    findings = sorted((f for f in (audits[-1]["findings"] if audits else []) if isinstance(f, dict)),
                      key=lambda f: _severity_rank(f.get("severity")))
    findings = [f for f in findings if f.get("severity") in ("error", "warning")]
    if not findings:
        return None
    owner, f = audits[-1], findings[0]
    card = Card(tone="", title="", fixes=_fix_views(f.get("fixes"), fix_cells(owner), fix_verdicts(owner)))
    where = f"the audit's {f.get('rule')} rule" + (f" ({plural(len(findings) - 1, 'more finding')} below)"
                                                  if len(findings) > 1 else "")
    return _Lead(card, f"{str(f.get('severity')).upper()}: {f.get('title', '')}", where,
                 f.get("severity") == "error", charts)


def story_fix(doc: dict) -> FixView | None:
    """The one fix the story of ``doc`` recommends (``recommended_fix`` of the card that leads it), from the
    document's data: None when nothing went wrong, when no fix was offered, or when none run was verified."""
    lead = _lead(doc)
    return recommended_fix(lead.card.fixes) if lead is not None else None


def _story(doc: dict) -> list[Section]:
    """The first screen: what went wrong, where, and the fix to make (verified first), one line each (``_lead``
    picks what leads it)."""
    lead = _lead(doc)
    if lead is None:
        return []
    card = lead.card
    fix = recommended_fix(card.fixes)
    proof = []
    if not card.fixes:
        how = "none offered; the details below say what was seen"
    elif fix is not None:
        how = f"{fix.id}" + (f" ({fix.title})" if fix.title else "") + (
            f": verified {fix.verdict.where}" if fix.verdict else ": not verified yet")
        if fix.verdict and fix.verdict.detail:
            proof = [Fact(f"Proof: {fix.verdict.detail}")]
    else:
        wheres = {f.verdict.where for f in card.fixes if f.verdict}
        tried_where = wheres.pop() if len(wheres) == 1 else "on the failing step or by a re-audit of the trainer"
        how = (f"none verified {tried_where} ({plural(len(card.fixes), 'fix', 'es')} tried: "
               + ", ".join(f"{f.id} {f.verdict.label}" for f in card.fixes if f.verdict) + ")")
    return [Section(kind="story", title="What happened", facts=[
        Fact(f"What went wrong: {lead.what}", "bad" if lead.bad else ""), Fact(f"Where: {lead.where}"),
        Fact(f"Fix: {how}", "good" if fix and fix.verdict and fix.verdict.status == "verified" else ""), *proof,
        *_applied_facts(doc)], charts=lead.charts)]


def _applied_facts(doc: dict) -> list[Fact]:
    """The rest of the story once a fix was applied: that cell and its own verdict (never another
    variant's), then the first watch after it, or that none ran yet."""
    entries = _entries(doc)
    applied = [(i, f) for i, e in enumerate(entries) if e.get("kind") == "fix"
               for f in e.get("fixes_applied") or [] if isinstance(f, dict)]
    if not applied:
        return []
    at, last = applied[-1]
    verdicts: dict[tuple[str, str], Verdict] = {}
    for entry in [doc, *entries[:at]]:  # proof came before the fix: a run after it saw the fix already made
        verdicts.update(fix_verdicts(entry))
    fix_id = str(last.get("fix"))
    verdict = verdicts.get((fix_id, str(last.get("code"))))
    proof = (f"this cell {verdict.label} {verdict.where}" + (f" ({verdict.detail})" if verdict.detail else "")
             if verdict is not None else "this cell was not run on a failing step: not verified")
    facts = [Fact(f"Applied: {fix_id}: {proof}", "good" if verdict and verdict.status == "verified" else "")]
    after = [w for e in entries[at + 1:] for w in watch_sections(e)]
    if not after:
        return [*facts, Fact("Run after the fix: none yet")]
    steps = history_overview(after[0]["history"]).get("n_steps") or 0
    events = [e for e in after[0]["events"] if isinstance(e, dict)]
    if events:
        first = events[0]
        return [*facts, Fact(f"Run after the fix: {plural(steps, 'step')}, {plural(len(events), 'event')}; first: "
                             f"step {first.get('step')}: {first.get('message', first.get('kind'))}", "bad")]
    return [*facts, Fact(f"Run after the fix: {plural(steps, 'step')}, no events", "good")]


def _entries(doc: dict) -> list[dict]:
    return [e for e in doc.get("entries") or [] if isinstance(e, dict)]


ENTRY_NAMES = {"audit": "Audit", "watch": "Watch", "fix": "Fix applied", "diagnosis": "Explained exception",
               "verification": "Fix verification"}


def _entry_title(number: int, entry: dict) -> str:
    name = ENTRY_NAMES.get(str(entry.get("kind")), str(entry.get("kind", "entry")).capitalize())
    if entry.get("kind") == "fix":
        fixes = [str(f.get("fix")) for f in entry.get("fixes_applied") or [] if isinstance(f, dict)]
        name += ": " + ", ".join(fixes) if fixes else ""
    elif entry.get("kind") == "audit":
        findings = entry.get("findings") or []
        name += f": {plural(len(findings), 'finding')}" if isinstance(findings, list) else ""
    when = entry.get("time")
    return f"{number}. {name}" + (f" ({format_time(when)})" if when is not None else "")


def _sections(doc: dict, path: list[Any]) -> list[Section]:
    out: list[Section] = []
    for name, build in _BUILDERS:
        try:
            out.extend(build(doc, path))
        except Exception as exc:  # one odd section must not hide the rest
            out.append(Section(kind="notes", notes=[f"could not render {name}: {exc!r}"]))
    return out


def _summary(doc: dict) -> str:
    """One line that says whether anything is wrong, before any detail."""
    docs = [doc, *_entries(doc)]
    bits = []
    findings_lists = [d["findings"] for d in docs if isinstance(d.get("findings"), list)]
    if findings_lists:
        findings = findings_lists[-1]  # the latest audit says how the run stands now
        counts = sorted(severity_counts(findings).items(), key=lambda kv: _severity_rank(kv[0]))
        detail = f" ({', '.join(plural(n, sev) for sev, n in counts)})" if counts else ""
        bits.append(plural(len(findings), "finding") + detail + (" at the last audit" if len(findings_lists) > 1 else ""))
    watches = [w for d in docs for w in watch_sections(d)]
    if watches:
        bits.append(plural(sum(len(w["events"]) for w in watches), "watch event"))
    n_diag = sum(len(d.get("diagnoses") or []) for d in docs)
    if n_diag:
        bits.append(plural(n_diag, "explained exception"))
    n_fix = sum(len(d.get("fixes_applied") or []) for d in docs)
    if n_fix:
        bits.append(f"{n_fix} fix{'es' if n_fix != 1 else ''} applied")
    return " · ".join(bits)


def severity_counts(findings: list) -> dict[str, int]:
    counts: dict[str, int] = {}
    for f in findings:
        sev = str(f.get("severity")) if isinstance(f, dict) else "?"
        counts[sev] = counts.get(sev, 0) + 1
    return counts


def _severity_rank(severity: Any) -> int:
    return SEVERITY_ORDER.index(severity) if severity in SEVERITY_ORDER else len(SEVERITY_ORDER)


def _tone(severity: Any) -> str:
    return severity if severity in SEVERITY_ORDER else "info"


MAX_EVIDENCE_ROWS = 14


def _cell(key: str, value: Any) -> str:
    """One evidence value in words: sizes in GB/MB, NaN for "nan", — for nothing, short lists inline."""
    if value is None:
        return MISSING
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (int, float)) and key.endswith("_bytes"):
        return fmt_bytes(value)
    if isinstance(value, (int, float)) or value in ("nan", "inf", "-inf"):
        return fmt_num(value)
    if isinstance(value, dict) and set(value) == {"first", "count"} and isinstance(value["first"], list):
        shown = [_cell(key, v) for v in value["first"]]
        more = int(value["count"]) - len(shown)
        return "; ".join(shown) + (f" (+{more} more)" if more > 0 else "")
    if isinstance(value, dict):
        return ", ".join(f"{k} {_cell(str(k), v)}" for k, v in value.items())
    if isinstance(value, list):
        return "; ".join(_cell(key, v) for v in value) if value else MISSING
    return str(value)


def _evidence_rows(value: dict, prefix: str = "") -> list[list[str]]:
    rows = []
    for key, item in value.items():
        name = f"{prefix}{key}"
        nested = isinstance(item, dict) and item and not (set(item) == {"first", "count"}) and not prefix
        rows += _evidence_rows(item, f"{name} › ") if nested else [[name, _cell(str(key), item)]]  # names as written
    return rows


def _evidence_fold(label: str, value: Any) -> Fold:
    """Evidence as a small table of name and value (the JSON stays in the document and to_dict())."""
    if not isinstance(value, dict):
        return Fold(label=label, text=pretty_json(value), short=short_json(value))
    rows = _evidence_rows(value)
    more = len(rows) - MAX_EVIDENCE_ROWS
    rows = [[k, _clip(v)] for k, v in rows[:MAX_EVIDENCE_ROWS]]
    note = f"{more} more not shown; all of them are in the document (to_document())." if more > 0 else ""
    width = max((len(k) for k, _ in rows), default=0)
    text = "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows) + (f"\n{note}" if note else "")
    return Fold(label=label, text=text, short=_clip("; ".join(f"{k} {v}" for k, v in rows)), kind="text",
                table=Table(columns=[], rows=rows, note=note))


def _clip(text: str, width: int = 160) -> str:
    return text if len(text) <= width else text[:width - 1] + "…"


def _notes(doc: dict, path: list[Any]) -> list[Section]:
    notes = [str(n) for n in doc.get("notes") or []]
    return [Section(kind="notes", notes=notes)] if notes else []


def hardware_line(hw: dict) -> str:
    parts = [str(hw.get("display_name") or hw.get("name") or "?")]
    cc = hw.get("compute_capability")
    if cc:
        parts.append("compute capability " + ".".join(str(c) for c in cc))
    if hw.get("memory_gb"):
        parts.append(f"{fmt_num(hw['memory_gb'])} GB")
    if "native_bf16" in hw:
        parts.append("native bf16" if hw["native_bf16"] else "no native bf16")
    if hw.get("detected") is not None:
        parts.append("detected" if hw.get("detected") else "profile")
    return ", ".join(parts)


def _hardware(doc: dict, path: list[Any]) -> list[Section]:
    hw = doc.get("hardware")
    if not isinstance(hw, dict):
        return []
    return [Section(kind="hardware", title="Hardware", facts=[Fact(hardware_line(hw))])]


def _counts(counts: Any) -> str:
    return ", ".join(f"{k} ({v})" for k, v in counts.items()) if isinstance(counts, dict) and counts else "?"


def _stack(doc: dict, path: list[Any]) -> list[Section]:
    """What the audit read of the stack: 4-bit layers and the dtype they really compute in, Unsloth's
    precision switches, and whether training fits the GPU's memory."""
    stack = doc.get("stack")
    if not isinstance(stack, dict):
        return []
    facts = []
    q = stack.get("quantization")
    if isinstance(q, dict) and (q.get("layers_4bit") or q.get("layers_8bit")):
        if q.get("layers_4bit"):
            facts.append(Fact(f"{q['layers_4bit']} bitsandbytes 4-bit layers ({_counts(q.get('quant_types'))}) computing in "
                              f"{_counts(q.get('compute_dtypes'))}; config bnb_4bit_compute_dtype "
                              f"{q.get('config_compute_dtype') or MISSING}; LoRA on {q.get('lora_on_4bit', 0)} of them; "
                              f"prepared for k-bit training: {'yes' if q.get('kbit_prepared') else 'no'}"))
        if q.get("layers_8bit"):
            facts.append(Fact(f"{q['layers_8bit']} bitsandbytes 8-bit layers"))
    u = stack.get("unsloth")
    if isinstance(u, dict) and (u.get("loaded") or u.get("trainer")):
        bits = [f"Unsloth {u.get('version') or ''}".strip() + (" trainer" if u.get("trainer") else "")]
        if u.get("forced_float32") is not None:
            bits.append(f"forced float32: {'yes' if u['forced_float32'] else 'no'}"
                        + (f" ({u['forced_from']})" if u.get("forced_from") else ""))
        if u.get("mixed_precision"):
            bits.append(f"UNSLOTH_MIXED_PRECISION={u['mixed_precision']}")
        if u.get("compile_disabled"):
            bits.append(f"UNSLOTH_COMPILE_DISABLE={u['compile_disabled']}")
        facts.append(Fact("; ".join(bits)))
    m = stack.get("memory")
    if isinstance(m, dict) and isinstance(m.get("as_is"), dict):
        target = m.get("target_precision")
        line = (f"training memory on {m.get('hardware')} ({fmt_num(m.get('memory_gb'))} GB), weights, gradients and "
                f"optimizer state: as stored {fmt_bytes(_training_bytes(m['as_is']))}")
        if target and isinstance(m.get(target), dict):
            line += (f", in {target} {fmt_bytes(_training_bytes(m[target]))} "
                     f"({'fits' if m.get('target_fits') else 'does not fit'})")
        if isinstance(m.get("partial"), dict):
            line += f"; fp32 for the overflowing layers only: {fmt_bytes(_training_bytes(m['partial']))}"
        if as_float(m["as_is"].get("reserve_bytes")):
            line += f"; plus {fmt_bytes(m['as_is']['reserve_bytes'])} kept for the CUDA context and allocator"
        if not m.get("activations_counted", True):
            line += "; activations not counted"
        facts.append(Fact(line, "" if m.get("target_fits", True) else "bad"))
    return [Section(kind="stack", title="Stack", facts=facts)] if facts else []


def fix_cells(doc: dict) -> dict[str, dict]:
    cells = doc.get("fix_cells")
    if not isinstance(cells, dict):
        return {}
    return {str(k): v if isinstance(v, dict) else {"code": str(v)} for k, v in cells.items()}


def _status(verdict: Any) -> str:
    """A verdict as a CSS-safe status: "verified", "not-enough" or "not-checked"."""
    return str(verdict).strip().replace(" ", "-")


def _verdict_lists(doc: dict) -> Iterator[list]:
    """Every list of fix verdicts a document carries: its own verification (a verification or an audit
    document), its diagnoses' and its events' (the watch verifies the first localised event)."""
    owners = [doc.get("verification"), *((d or {}).get("verification") for d in doc.get("diagnoses") or [])]
    owners += [((e or {}).get("evidence") or {}).get("verification") for e in doc.get("events") or []]
    for owner in owners:
        if isinstance(owner, dict) and isinstance(owner.get("verdicts"), list):
            yield [v for v in owner["verdicts"] if isinstance(v, dict)]


def fix_verdicts(doc: dict) -> dict[tuple[str, str], Verdict]:
    """The best verdict per verified cell over the document's verifications (verified beats not
    enough), keyed by (fix id, the exact code that ran): a cell shows a verdict only when it is the
    text that ran, never another variant of the same fix."""
    best: dict[tuple[str, str], Verdict] = {}
    found = [((str(v.get("fix")), str(v.get("code"))), _status(v.get("verdict")), str(v.get("reason") or ""))
             for verdicts in _verdict_lists(doc) for v in verdicts if isinstance(v.get("code"), str)]
    for key, status, reason in found:
        if status not in VERDICT_ORDER:
            continue
        if key not in best or VERDICT_ORDER.index(status) < VERDICT_ORDER.index(best[key].status) or (
                status == best[key].status and reason and not best[key].detail):
            best[key] = Verdict(status=status, label=status.replace("-", " "), detail=reason)
    return best


VERDICT_ORDER = ("verified", "not-enough", "not-checked")


def _fix_views(fix_ids: Any, cells: dict[str, dict], verdicts: dict[tuple[str, str], Verdict]) -> list[FixView]:
    fixes = []
    for fid in fix_ids or []:
        code = str(cells.get(str(fid), {}).get("code") or "")
        fixes.append(FixView(id=str(fid), title=str(cells.get(str(fid), {}).get("title") or ""), code=code,
                             verdict=verdicts.get((str(fid), code))))  # the verdict of this very text, or none
    return ranked(fixes)


# -- the one recommended fix ---------------------------------------------------------------------
# The rule every face follows (docs/guides/verified-fixes.md, "The recommended fix"): the verdict belongs to
# the very cell shown (the variant the target hardware runs); verified on the failing step beats verified by
# a re-audit (which ran no step); among fixes verified alike, one that sets the precision the origin module
# was measured to fit in (the verification's module check) removes the measured cause and comes first;
# otherwise the producer's order holds (the fix registry's rank for a watch event, the finding's own order).
# Unverified fixes come next in the producer's order, and those shown not to help last.
VERDICT_RANK = {"verified": 0, "not-checked": 2, "not-enough": 3}


def _verdict_rank(fix: FixView) -> int:
    if fix.verdict is None:
        return 2
    if fix.verdict.status == "verified":
        return 1 if fix.verdict.where != "on the failing step" else 0
    return VERDICT_RANK.get(fix.verdict.status, 2)


def ranked(fixes: list[FixView]) -> list[FixView]:
    """The fixes in the order of the rule above (a stable sort: ties keep the order they were given in)."""
    return sorted(fixes, key=_verdict_rank)


def recommended_fix(fixes: list[FixView]) -> FixView | None:
    """The one fix to make, by the rule above: the first of ``ranked(fixes)`` when it is verified, or when
    nothing was run at all (an audit offers its worst finding's first fix, not verified yet); None when fixes
    were run and none was verified. The story, the cards, the text and HTML, the widgets and the report all
    call this, so they name the same fix."""
    if not fixes:
        return None
    first = ranked(fixes)[0]
    if first.verdict is not None and first.verdict.status == "verified":
        return first
    return first if all(f.verdict is None for f in fixes) else None


def _fits_measured_precision(item: dict, check: Any) -> bool:
    """Whether a fix's options set a precision the origin module was measured to fit in (module check's
    ``fits``: {"float16": False, "bfloat16": True, "float32": True}): it removes the cause the check measured."""
    fits = check.get("fits") if isinstance(check, dict) else None
    to = (item.get("options") or {}).get("to") if isinstance(item.get("options"), dict) else None
    if not isinstance(fits, dict) or not isinstance(to, str):
        return False
    return bool(fits.get(PRECISION_NAMES.get(to, to)))


PRECISION_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _findings(doc: dict, path: list[Any]) -> list[Section]:
    findings = doc.get("findings")
    if not isinstance(findings, list):
        return []
    if not findings:
        return [Section(kind="findings", title="Findings", empty="No findings: nothing to fix.")]
    cells, verdicts = fix_cells(doc), fix_verdicts(doc)
    counts = severity_counts(findings)
    facts = [Fact(", ".join(plural(n, sev) for sev, n in sorted(counts.items(), key=lambda kv: _severity_rank(kv[0]))))]
    cards = []
    for f in sorted((f for f in findings if isinstance(f, dict)), key=lambda f: _severity_rank(f.get("severity"))):
        sev = str(f.get("severity", "info"))
        cards.append(Card(
            tone=_tone(sev), badge=sev.upper(), title=str(f.get("title", "")), tag=str(f.get("rule", "")),
            lines=[str(f["detail"])] if f.get("detail") else [],
            folds=[_evidence_fold("evidence", f["evidence"])] if f.get("evidence") else [],
            fixes=_fix_views(f.get("fixes"), cells, verdicts),
        ))
    return [Section(kind="findings", title=f"Findings ({len(findings)})", facts=facts, cards=cards)]


def headroom_key(module: dict) -> float:
    """Sort key: least headroom first; an overflowed module (abs-max inf/nan) counts as 0."""
    headroom = as_float(module.get("headroom"))
    if headroom is not None and math.isfinite(headroom):
        return headroom
    absmax = as_float(module.get("absmax"))
    if absmax is not None and not math.isfinite(absmax):
        return 0.0
    return math.inf


def _over(headroom: Any) -> bool:
    value = as_float(headroom)
    return value is not None and (not math.isfinite(value) or value < 1)


def _probe(doc: dict, path: list[Any]) -> list[Section]:
    probe = doc.get("probe")
    if not isinstance(probe, dict):
        return []
    if not isinstance(probe.get("modules") or [], list):
        raise TypeError(f"probe modules must be a list, got {type(probe.get('modules')).__name__}")
    modules = sorted((m for m in probe.get("modules") or [] if isinstance(m, dict)), key=headroom_key)
    over = sum(1 for m in modules if headroom_key(m) < 1)
    backward = any(m.get("grad_absmax") is not None for m in modules)  # the probe read gradients too
    rows, bad_rows = [], []
    for index, m in enumerate(modules[:MAX_PROBE_ROWS]):
        bad = headroom_key(m) < 1
        headroom = "overflow" if m.get("headroom") is None and bad else f"{fmt_num(m.get('headroom'), 3)}×"
        row = [str(m.get("module")), str(m.get("dtype") or ""), fmt_num(m.get("absmax")), fmt_num(m.get("input_absmax"))]
        if backward:
            grad_bad = _over(m.get("grad_headroom"))
            row.append(fmt_num(m.get("grad_absmax")) + (" ⚠ over limit" if grad_bad else ""))
            bad = bad or grad_bad
        rows.append([*row, headroom + (" ⚠ over limit" if headroom_key(m) < 1 else "")])
        if bad:
            bad_rows.append(index)
    more = len(modules) - len(rows)
    columns = ["module", "dtype", "output abs-max", "input abs-max", *(["gradient abs-max"] if backward else []), "headroom"]
    table = Table(columns=columns, rows=rows, numeric=[False, False] + [True] * (len(columns) - 2),
                  code=[True] + [False] * (len(columns) - 1), bad_rows=bad_rows,
                  note=f"{more} more modules with more headroom not shown." if more > 0 else "")
    facts = [Fact(f"Limit {fmt_num(probe.get('limit', 65504.0))}: {plural(len(modules), 'module')}, {over} at or over "
                  "the limit (least headroom first)", "bad" if over else "")]
    if backward:
        grads = [as_float(m.get("grad_absmax")) for m in modules]
        nonfinite = sum(1 for g in grads if g is not None and not math.isfinite(g))
        grad_over = sum(1 for m, g in zip(modules, grads) if g is not None and math.isfinite(g)
                        and _over(m.get("grad_headroom")))
        text = f"backward: {plural(grad_over, 'module')} with gradients at or over the limit"
        if nonfinite:
            text += f", {nonfinite} with inf/NaN gradients"
        facts.append(Fact(text, "bad" if grad_over or nonfinite else ""))
    return [Section(kind="probe", title="Activation probe", facts=facts, table=table)]


def watch_sections(doc: dict) -> Iterator[dict]:
    """Each watch in ``doc`` as {"title", "events", "history", "activations", "summary", "path"}.

    A report holds a list under "watches"; a single watch's document carries its "events",
    "history" and "activations" at the top level. Both are read, in that order.
    """
    watches = doc.get("watches")
    if isinstance(watches, list):
        for index, watch in enumerate(watches):
            if isinstance(watch, dict):
                yield {"title": watch.get("title") or f"Watch {index + 1}", "events": watch.get("events") or [],
                       "history": watch.get("history"), "activations": watch.get("activations"),
                       "summary": watch.get("summary"), "path": ["watches", index]}
    if any(doc.get(key) for key in ("events", "history", "activations")):
        yield {"title": None, "events": doc.get("events") or [], "history": doc.get("history"),
               "activations": doc.get("activations"), "summary": doc.get("summary"), "path": []}


def history_overview(history: Any) -> dict[str, Any]:
    """The numbers a reader wants first from a grad-norm history: size, skipped steps and the
    first non-finite cell (step, group, value, how many groups)."""
    if not isinstance(history, dict):
        return {}
    import numpy as np  # only when a history is shown: `import nbguard` stays light

    from .grid import decode_grid

    groups = [str(g) for g in history.get("groups") or []]
    steps = list(history.get("steps") or [])
    values, missing = decode_grid(history.get("grad_norm"), len(groups), len(steps))
    bad = ~np.isfinite(values) & ~missing
    first_bad = None
    if bad.any():
        col = int(np.flatnonzero(bad.any(axis=0))[0])
        rows = np.flatnonzero(bad[:, col])
        first_bad = (steps[col], groups[int(rows[0])], fmt_num(float(values[int(rows[0]), col])), int(rows.size))
    loss = [as_float(v) for v in history.get("loss") or []]
    finite_loss = [v for v in loss if v is not None and math.isfinite(v)]
    return {
        "n_groups": len(groups),
        "n_steps": len(steps),
        "first_step": steps[0] if steps else None,
        "last_step": steps[-1] if steps else None,
        "skipped_steps": list(history.get("skipped_steps") or []),
        "first_nonfinite": first_bad,
        "nonfinite_cells": int(bad.sum()),
        "finite_cells": int((np.isfinite(values) & ~missing).sum()),
        "nonfinite_loss_steps": [s for s, v in zip(steps, loss) if v is not None and not math.isfinite(v)],
        "loss_first": finite_loss[0] if finite_loss else None,
        "loss_last": finite_loss[-1] if finite_loss else None,
        "has_loss": any(v is not None for v in loss),
        "update": _update_overview(steps, history),
    }


def _update_overview(steps: list, history: dict) -> dict[str, Any] | None:
    """The optimizer's update relative to the weights (||Δw|| / ||w||): its median and largest, or why
    the watch has none; None for a document from before update norms."""
    if history.get("update_norm_unavailable"):
        return {"unavailable": str(history["update_norm_unavailable"])}
    totals = [(s, as_float(v)) for s, v in zip(steps, history.get("total_update_norm") or [])]
    finite = sorted((v, s) for s, v in totals if v is not None and math.isfinite(v))
    if not finite:
        return None
    peak, at = finite[-1]
    sampled = history.get("update_norm_sampled")
    return {"median": finite[len(finite) // 2][0], "peak": peak, "peak_step": at, "steps": len(finite),
            "sampled": dict(sampled) if isinstance(sampled, dict) else None}


def where_bad(group: str, count: int, total: int) -> str:
    """Where the first non-finite step hit: one group by name, or how many (all of them when the
    NaN spread through the backward pass)."""
    if count <= 1:
        return group
    return f"{'all ' if count == total else ''}{count} of {total} groups (first: {group})"


def overview_facts(overview: dict) -> list[Fact]:
    facts = [Fact(f"{plural(overview['n_groups'], 'module group')} × {plural(overview['n_steps'], 'step')}"
                  + (f" (steps {overview['first_step']}–{overview['last_step']})" if overview["n_steps"] else ""))]
    if overview["first_nonfinite"]:
        step, group, value, count = overview["first_nonfinite"]
        facts.append(Fact(f"first non-finite gradient: {value} at step {step} in "
                          f"{where_bad(group, count, overview['n_groups'])} "
                          f"({overview['nonfinite_cells']} non-finite cells in all)", "bad"))
    elif overview["n_steps"]:
        facts.append(Fact("all gradient norms finite", "good"))
    skipped = overview["skipped_steps"]
    if skipped:
        shown = ", ".join(str(s) for s in skipped[:20]) + (" …" if len(skipped) > 20 else "")
        facts.append(Fact(f"{plural(len(skipped), 'skipped step')}: {shown}", "skip"))
    if overview["loss_first"] is not None:
        facts.append(Fact(f"loss {fmt_num(overview['loss_first'])} → {fmt_num(overview['loss_last'])}"))
    if overview["nonfinite_loss_steps"]:
        facts.append(Fact(f"loss non-finite at {plural(len(overview['nonfinite_loss_steps']), 'step')}", "bad"))
    update = overview.get("update")
    if update and update.get("unavailable"):
        facts.append(Fact(f"no update norms: {update['unavailable']}"))
    elif update:
        sampled = update.get("sampled")
        estimated = (f" (estimated from 1/{sampled.get('parts')} of each weight's rows from step "
                     f"{sampled.get('from_step')})" if sampled else "")
        facts.append(Fact(f"update ‖Δw‖/‖w‖{estimated}: median {fmt_num(update['median'])}, largest "
                          f"{fmt_num(update['peak'])} at step {update['peak_step']}"))
    return facts


# An event card's title and its kind tag share one line of render/text.py's 100 columns (less the card's indent and
# the tag's brackets); a Lab or HTML card at the usual notebook width holds as much. The rest goes to the body.
CARD_HEAD_CHARS = 94


def split_title(head: str, text: str, room: int) -> tuple[str, str]:
    """(title, rest): ``head`` and as much of ``text`` as fits ``room`` characters, ended where a reader would
    pause (after a whole ``;`` clause, else after a comma or colon or before a parenthesis, unless that leaves
    a third of the room unused, else at the last space that fits), never inside parentheses; ``rest`` is the
    remainder of ``text``, word for word."""
    whole = f"{head}: {text}" if text else head
    if len(whole) <= room:
        return whole, ""
    fits = room - len(head) - 2
    clauses: list[int] = []
    phrases: list[int] = []
    words: list[int] = []
    depth = 0
    for index, char in enumerate(text[:fits + 1]):
        if depth == 0 and char == " " and index > 0:
            before, after = text[index - 1], text[index + 1:index + 2]
            if before == ";":
                clauses.append(index - 1)
            else:
                (phrases if before in ",:" or after == "(" else words).append(index)
        depth = max(0, depth + (char == "(") - (char == ")"))
    phrase = max(phrases, default=0)
    cut = max(clauses) if clauses else phrase if phrase >= fits * 2 // 3 else max([phrase, *words])
    if cut <= 0:
        return head, text
    return f"{head}: {text[:cut].rstrip(':,;')}", text[cut:].lstrip(";, ")


def event_card(event: dict, cells: dict[str, dict] | None = None,
               verdicts: dict[tuple[str, str], Verdict] | None = None, head: str | None = None) -> Card:
    """One watch event as a card: step, kind, cause, message, its origins and evidence. Its title says what and
    where in one line (``split_title``: ``head``, by default its step, then the message's start); the rest of the
    message opens the body."""
    kind = str(event.get("kind", ""))
    rank = f"rank {event['rank']} · " if event.get("rank") is not None else ""
    origins = [o for o in event.get("origins") or [] if isinstance(o, dict)]
    table = None
    if origins:
        table = Table(
            columns=["phase", "origin module", "tensor", "dtype", "input abs-max", "output abs-max", "micro-batch"],
            rows=[[str(o.get("phase") or ""), str(o.get("module")), str(o.get("tensor") or ""), str(o.get("dtype") or ""),
                   fmt_num(o.get("input_absmax")), fmt_num(o.get("output_absmax")),
                   "" if o.get("micro_batch") is None else str(o.get("micro_batch"))] for o in origins],
            numeric=[False, False, False, False, True, True, True], code=[False, True, False, False, False, False, False])
    folds = [_evidence_fold(f"origin evidence ({o.get('phase')}: {o.get('module')})", o["evidence"])
             for o in origins if o.get("evidence")]
    evidence = {k: v for k, v in (event.get("evidence") or {}).items() if k != "verification"}
    if evidence:
        folds.append(_evidence_fold("evidence", evidence))
    # (the run checks put the fixes they offer in the evidence)
    fixes = _fix_views(event.get("fixes") or (event.get("evidence") or {}).get("fixes"), cells or {}, verdicts or {})
    verification = (event.get("evidence") or {}).get("verification")
    if isinstance(verification, dict):  # the fixes the watch ran on this very step, verified first
        fixes = ranked(verification_card(verification, "").fixes)
    title, rest = split_title(head or f"{rank}step {event.get('step')}", str(event.get("message", "")),
                              CARD_HEAD_CHARS - len(kind))
    lines = [rest] if rest else []
    lines += [f"cause: {event['cause']}"] if event.get("cause") else []
    next_steps = (event.get("evidence") or {}).get("next_steps")
    if isinstance(next_steps, list):  # the replay did not reproduce it: what to try instead
        lines += [f"try next: {step}" for step in next_steps]
    return Card(
        tone="error" if kind.startswith("nonfinite") else "warning",
        title=title, tag=kind,
        lines=lines,
        table=table, folds=folds, fixes=fixes,
    )


def fold_skips(events: list[dict]) -> list[dict]:
    """A GradScaler streak (every step a ``scaler-skip`` event) shown as its first event, which
    carries the localisation, with the streak's steps noted for its title."""
    out = []
    for first, last, count in fold_skip_streaks(
            events, lambda e: (str(e.get("kind")), e.get("step", -1), (e.get("evidence") or {}).get("streak_start"))):
        out.append({**first, "_folded": (first.get("step"), last, count)} if count > 1 else first)
    return out


def _event_cards(event: dict, cells: dict[str, dict], verdicts: dict[tuple[str, str], Verdict]) -> list[Card]:
    """An event's card, followed by the card of the verification the watch made on its step."""
    folded = event.get("_folded")
    head = f"steps {folded[0]}–{folded[1]} ({folded[2]} steps skipped by the GradScaler)" if folded else None
    cards = [event_card(event, cells, verdicts, head)]
    verification = (event.get("evidence") or {}).get("verification")
    if isinstance(verification, dict):  # its fixes are the event card's own: each fix offered once per output
        cards.append(replace(verification_card(verification, f"Fixes run on step {event.get('step')}"), fixes=[]))
    return cards


def _watch(doc: dict, path: list[Any]) -> list[Section]:
    out = []
    cells, verdicts = fix_cells(doc), fix_verdicts(doc)
    for watch in watch_sections(doc):
        history, acts, events = watch["history"], watch["activations"], watch["events"]
        overview = history_overview(history)
        facts = overview_facts(overview) if overview else []
        if isinstance(acts, dict):
            facts.append(Fact(f"activation abs-max recorded for {plural(len(acts.get('groups') or []), 'group')} × "
                              f"{plural(len(acts.get('steps') or []), 'step')} (limit {fmt_num(acts.get('limit', 65504.0))})"))
        at = [*path, *watch["path"]]
        charts = []
        if overview.get("n_steps") and overview.get("n_groups"):
            charts.append(Chart("heatmap", "gradient-norm heatmap", [*at, "history"],
                                empty=_all_nonfinite(overview, "gradient norm")))
        if overview.get("n_steps") and overview.get("n_groups") and _has_update_norms(history, overview):
            charts.append(Chart("updates", UPDATES_ALT, [*at, "history"]))
        if overview.get("n_steps") and (overview.get("has_loss") or _has_series(history)):
            charts.append(Chart("series", SERIES_ALT, [*at, "history"]))
        if isinstance(acts, dict) and acts.get("steps") and acts.get("groups"):
            charts.append(Chart("activations", "activation abs-max heatmap", [*at, "activations"]))
        shown = fold_skips([e for e in events if isinstance(e, dict)])[:MAX_EVENTS]
        notes = [f"{len(events) - MAX_EVENTS} more events not shown; all of them are in the document (to_document())."
                 ] if len(events) > MAX_EVENTS else []
        title = watch["title"] or (doc.get("title") if path else None)  # an entry of a report names its watch
        out.append(Section(
            kind="watch", title="Watch" + (f": {title}" if title else ""), facts=facts,
            cards=[card for e in shown for card in _event_cards(e, cells, verdicts)], charts=charts, notes=notes,
            empty="No events." if not events else "", cards_title=f"Events ({len(events)})" if events else ""))
    return out


def _has_series(history: Any) -> bool:
    return isinstance(history, dict) and any(
        any(v is not None for v in history.get(key) or []) for key in ("total_grad_norm", "loss_scale"))


def _has_update_norms(history: dict, overview: dict) -> bool:
    """Whether the watch recorded an update norm to draw: none where it could not read them (the
    overview's fact says why) or in a document from before update norms."""
    if not isinstance(history, dict) or history.get("update_norm_unavailable") or "update_norm" not in history:
        return False
    import numpy as np

    from .grid import decode_grid

    values, missing = decode_grid(history.get("update_norm"), overview["n_groups"], overview["n_steps"])
    return bool((np.isfinite(values) & ~missing).any())


def _all_nonfinite(overview: dict, what: str) -> str:
    """Plots of a series with no finite value say so instead of drawing an empty axis."""
    if overview.get("nonfinite_cells") and not overview.get("finite_cells"):
        return f"every {what} recorded is non-finite (NaN/Inf): nothing to draw on a scale"
    return ""


def verification_card(v: dict, title: str) -> Card:
    """A verification as a card: each candidate fix with its verdict, the evidence of its shadow step,
    and the exact cell that was verified."""
    rows = []
    for item in v.get("verdicts") or []:
        step = item.get("step") or {}
        rows.append([str(item.get("fix")), str(item.get("verdict") or ""), fmt_num(step.get("loss")),
                     fmt_num(step.get("total_grad_norm")),
                     fmt_num(step.get("largest_activation")) + (f" at {step['largest_activation_at']}"
                                                                if step.get("largest_activation_at") else ""),
                     str(step.get("precision") or ""), str(item.get("reason") or "")])
    lines = [str(check["summary"])] if isinstance(check := v.get("module_check"), dict) and check.get("summary") else []
    if v.get("step_skipped"):
        lines.append(f"step level not run: {v['step_skipped']}")
    lines.extend(str(note) for note in v.get("notes") or [])
    items = [item for item in v.get("verdicts") or [] if isinstance(item, dict)]
    # the verifier's order (verified, not enough, not checked), with the recommendation rule's tie-break among
    # the verified: a fix setting the precision the origin was measured to fit in comes first
    items.sort(key=lambda item: (_status(item.get("verdict")) != "verified",
                                 _status(item.get("verdict")) == "verified"
                                 and not _fits_measured_precision(item, v.get("module_check"))))
    fixes = [FixView(id=str(item.get("fix")), title=str(item.get("title") or ""), code=str(item.get("code") or ""),
                     verdict=Verdict(_status(item.get("verdict")), str(item.get("verdict")), str(item.get("reason") or "")))
             for item in items]
    table = Table(columns=["fix", "verdict", "loss", "total grad norm", "largest activation", "precision", "why"],
                  rows=rows, numeric=[False, False, True, True, True, False, False], code=[True] + [False] * 6,
                  bad_rows=[i for i, r in enumerate(rows) if r[1] == "not enough"]) if rows else None
    folds = [_evidence_fold("baseline step (no fix)", v["baseline"])] if v.get("baseline") else []
    if v.get("memory"):
        folds.append(_evidence_fold("memory estimate", v["memory"]))
    return Card(tone="info", title=title, tag=str(v.get("subject") or ""), lines=lines, table=table, folds=folds,
                fixes=fixes)


def _verifications(doc: dict, path: list[Any]) -> list[Section]:
    v = doc.get("verification")
    if not isinstance(v, dict):
        return []
    reaudited = any(isinstance(item, dict) and item.get("reaudit") for item in v.get("verdicts") or [])
    title = "Fixes run on the failing step" + (" or re-audited on the trainer as built" if reaudited else "")
    return [Section(kind="verifications", title="Verified fixes", cards=[verification_card(v, title)])]


def _diagnoses(doc: dict, path: list[Any]) -> list[Section]:
    diagnoses = [d for d in doc.get("diagnoses") or [] if isinstance(d, dict)]
    if not diagnoses:
        return []
    cells, verdicts = fix_cells(doc), fix_verdicts(doc)
    cards = []
    for d in diagnoses:
        folds = []
        if d.get("exception"):
            folds.append(Fold("exception text", str(d["exception"]), short=short_json(last_line(d["exception"])), kind="text"))
        if d.get("evidence"):
            folds.append(_evidence_fold("evidence", d["evidence"]))
        cards.append(Card(
            tone="error", title=str(d.get("title", "")), tag=str(d.get("signature", "")),
            lines=[str(d["detail"])] if d.get("detail") else [],
            quote=last_line(d["exception"]) if d.get("exception") else "", folds=folds,
            fixes=_fix_views(d.get("fixes"), cells, verdicts)))
        if isinstance(d.get("verification"), dict):  # the watch captured the failing step: what was run on it
            cards.append(verification_card(d["verification"], "Fixes run on the failing step"))
    return [Section(kind="diagnoses", title=f"Explained exceptions ({len(diagnoses)})", cards=cards)]


def _fixes_applied(doc: dict, path: list[Any]) -> list[Section]:
    applied = [a for a in doc.get("fixes_applied") or [] if isinstance(a, dict)]
    if not applied:
        return []
    cards = []
    for item in applied:
        changed = item.get("changed")
        cards.append(Card(
            tone="info", title=str(item.get("fix")), tag=format_time(item.get("time")),
            folds=[_evidence_fold("what changed", changed)] if changed not in (None, "", [], {}) else [],
            code=str(item.get("code") or "")))
    return [Section(kind="fixes_applied", title=f"Fixes applied ({len(applied)}, in order)", cards=cards)]


def _fix_cells(doc: dict, path: list[Any]) -> list[Section]:
    cells = fix_cells(doc)
    referenced = {str(fid) for f in doc.get("findings") or [] if isinstance(f, dict) for fid in f.get("fixes") or []}
    referenced |= {str(fid) for d in doc.get("diagnoses") or [] if isinstance(d, dict) for fid in d.get("fixes") or []}
    loose = {k: v for k, v in cells.items() if k not in referenced}  # the rest show under their findings
    if not loose:
        return []
    cards = [Card(tone="info", title=str(cell.get("title") or ""), tag=fix_id, code=str(cell.get("code") or ""))
             for fix_id, cell in loose.items()]
    return [Section(kind="fix_cells", title="Fix cells", cards=cards)]


def _environment(doc: dict, path: list[Any]) -> list[Section]:
    env = doc.get("environment")
    if not isinstance(env, dict):
        return []
    rows = [["Python", env.get("python")], ["Platform", env.get("platform")], ["torch CUDA", env.get("torch_cuda")]]
    if isinstance(env.get("hardware"), dict):
        rows.append(["Device", hardware_line(env["hardware"])])
    packages = env.get("packages") or {}
    rows.extend([str(name), version] for name, version in packages.items())
    for key, value in env.items():
        if key not in ("python", "platform", "torch_cuda", "hardware", "packages"):
            rows.append([key, value if isinstance(value, str) else json.dumps(value, default=str)])
    key_packages = ", ".join(f"{k} {v}" for k, v in packages.items() if k in KEY_PACKAGES)
    line = f"Python {env.get('python', '?')} on {env.get('platform', '?')}"
    if env.get("torch_cuda"):
        line += f", CUDA {env['torch_cuda']}"
    facts = [Fact(line)] + ([Fact(key_packages)] if key_packages else [])
    table = Table(columns=["", ""], rows=[[str(k), MISSING if v is None else str(v)] for k, v in rows])
    return [Section(kind="environment", title="Environment", facts=facts, table=table, folded=True)]


# The section order every face shows (a report's entries follow; the environment closes it).
_BUILDERS: list[tuple[str, Callable[[dict, list[Any]], list[Section]]]] = [
    ("notes", _notes), ("hardware", _hardware), ("stack", _stack), ("findings", _findings), ("probe", _probe), ("watches", _watch),
    ("verifications", _verifications), ("diagnoses", _diagnoses), ("fixes applied", _fixes_applied),
    ("fix cells", _fix_cells), ("environment", _environment),
]


def lookup(doc: dict, path: list[Any]) -> Any:
    """The part of ``doc`` a chart's ``source`` names (None if it is not there)."""
    node: Any = doc
    for key in path:
        try:
            node = node[key]
        except (KeyError, IndexError, TypeError):
            return None
    return node


def without_view(doc: dict) -> dict:
    """``doc`` without the ``view`` a displayed bundle carries: the view is derived data, made anew
    from the document whenever it is shown, merged or saved."""
    return {k: v for k, v in doc.items() if k != "view"} if isinstance(doc, dict) and "view" in doc else doc
