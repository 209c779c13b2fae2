"""Plain text of a document: the terminal, Colab's text fallback, ``print(result)``.

A formatter of :func:`nbguard.document.view.view`: it decides layout only, never what is shown.
"""
from __future__ import annotations

import textwrap
from dataclasses import replace
from typing import Any

from ..document.redact import redact
from ..document.view import Card, FixView, Section, Table, View, ranked, recommended_fix, view

WIDTH = 100
MAX_CARDS = 20


def render_text(doc: dict, *, full: bool = False) -> str:
    """A compact, readable text view of every section present in ``doc``, redacted: ``print(result)``
    is pasted into bug reports like any saved output.

    By default one screen: what went wrong, where, the recommended fix with its verdict and one line of
    proof, each card in a line or two; ``full=True`` adds what the default leaves out (every fix's cell,
    the evidence, the verification table), and the default's last line says how to ask for it."""
    return format_view(view(redact(doc)), full=full)


FULL_HINT = ("More (other fixes, evidence, each fix's cell): folded in the HTML view; %nbguard fix ID puts a fix's cell\n"
             "below; print(nbguard.render.render_text(x.to_document(), full=True)) prints all of result x")


def format_view(v: View, *, full: bool = False) -> str:
    lines = [f"{v.title}  ({v.meta})"]
    if v.summary:
        lines.append(v.summary)
    printed: dict[tuple[str, str], str] = {}  # each fix cell once: an event's card and its verification share them
    left_out: list[bool] = []  # the compact view notes here whether it left anything out
    for section in v.sections:
        lines.extend(section_lines(section, printed) if full else compact_section_lines(section, left_out))
    if any(left_out):
        lines.append(FULL_HINT)
    return "\n".join(line.rstrip() for line in lines).rstrip() + "\n"


def _wrap(text: Any, indent: str) -> list[str]:
    out: list[str] = []
    for para in str(text).splitlines() or [""]:
        out.extend(textwrap.wrap(para, WIDTH, initial_indent=indent, subsequent_indent=indent) or [indent])
    return out


COMPACT_TABLE_ROWS = 5  # the probe's table on the first screen: the modules with the least headroom


def compact_section_lines(section: Section, left_out: list[bool]) -> list[str]:
    """A section on the first screen: its facts, each card as a title and its fixes in one line; what it
    leaves out (cells, evidence, long tables) is one call away (``FULL_HINT``)."""
    if section.kind in ("notes", "entry"):
        return section_lines(section)
    lines = [section.title] if section.title else []
    lines.extend(f"  {fact.text}" for fact in section.facts)
    if section.table and section.kind != "environment":
        rows = section.table.rows
        table = replace(section.table, rows=rows[:COMPACT_TABLE_ROWS],
                        note=f"{len(rows) - COMPACT_TABLE_ROWS} more rows not shown" if len(rows) > COMPACT_TABLE_ROWS
                        else section.table.note)
        lines.extend(table_lines(table, "  "))
        left_out.append(len(rows) > COMPACT_TABLE_ROWS)
    if section.empty:
        lines.append(f"  {section.empty}")
    if section.cards_title:
        lines.append(f"  {section.cards_title}:")
    for card in section.cards[:MAX_CARDS]:
        lines.extend(compact_card_lines(card, "  "))
        left_out.append(bool(card.folds or card.code or card.fixes or _is_verification(card)))
    if len(section.cards) > MAX_CARDS:
        lines.append(f"  … {len(section.cards) - MAX_CARDS} more")
    lines.extend(f"  {chart.alt}: {chart.empty}" for chart in section.charts if chart.empty)
    lines.extend(f"  {note}" for note in section.notes)
    return lines


def compact_card_lines(card: Card, indent: str) -> list[str]:
    """A card in a few lines: title, cause, the quote, an event's origin table, and its fixes in one line
    (the recommended one first); a verification's card keeps its module check and its fixes line."""
    head = f"[{card.badge}] " if card.badge else ""
    lines = [f"{indent}{head}{card.title}" + (f"  ({card.tag})" if card.tag else "")]
    inner = indent + "    "
    for line in card.lines:  # a finding's explanation in two lines at most; a cause, what to try next in full
        wrapped = _wrap(line, inner)
        cut = card.badge and len(wrapped) > 2
        lines.extend([wrapped[0], wrapped[1] + " …"] if cut else wrapped)
    if card.quote:
        lines.append(f"{inner}> {_clip(card.quote)}")
    if card.table and not _is_verification(card):
        lines.extend(table_lines(card.table, inner))
    if card.fixes:
        lines.append(f"{inner}{fixes_line(card.fixes)}")
    return lines


def _is_verification(card: Card) -> bool:
    """A verification's card: its wide table of verdicts and evidence is the full view's (its fixes line says it)."""
    return bool(card.table and card.table.columns[:2] == ["fix", "verdict"])


def fixes_line(fixes: list[FixView]) -> str:
    """The fixes of a card in one line: the one ``recommended_fix`` picks first, then the others ranked."""
    best = recommended_fix(fixes)
    others = [f for f in ranked(fixes) if f is not best]

    def name(fix: FixView) -> str:
        return fix.id + (f" [{fix.verdict.label}]" if fix.verdict else "")

    head = f"fix: {name(best)}" if best is not None else "no fix verified"
    return head + (f"; other{'s' if len(others) > 1 else ''}: " + ", ".join(name(f) for f in others) if others else "")


def _clip(text: Any, width: int = WIDTH) -> str:
    text = str(text).replace("\n", " ")
    return text if len(text) <= width else text[:width - 1] + "…"


def section_lines(section: Section, printed: dict[tuple[str, str], str] | None = None) -> list[str]:
    if section.kind == "notes":
        return [f"Note: {note}" for note in section.notes]
    if section.kind == "entry":
        return ["", f"== {section.title} =="]
    lines = [section.title] if section.title else []
    lines.extend(f"  {fact.text}" for fact in section.facts)
    if section.table and section.kind != "environment":
        lines.extend(table_lines(section.table, "  "))
    if section.empty:
        lines.append(f"  {section.empty}")
    if section.cards_title:
        lines.append(f"  {section.cards_title}:")
    for card in section.cards[:MAX_CARDS]:
        lines.extend(card_lines(card, "  ", printed))
    if len(section.cards) > MAX_CARDS:
        lines.append(f"  … {len(section.cards) - MAX_CARDS} more")
    lines.extend(f"  {chart.alt}: {chart.empty}" for chart in section.charts if chart.empty)
    lines.extend(f"  {note}" for note in section.notes)
    return lines


def card_lines(card: Card, indent: str, printed: dict[tuple[str, str], str] | None = None) -> list[str]:
    """A card's lines. A fix cell already in ``printed`` (the same fix, the same code: cell -> the verdict
    printed with it) is named, not repeated, and so is its verdict's reason when it is the same."""
    head = f"[{card.badge}] " if card.badge else ""
    lines = [f"{indent}{head}{card.title}" + (f"  ({card.tag})" if card.tag else "")]
    inner = indent + "    "
    for line in card.lines:
        lines.extend(_wrap(line, inner))
    if card.quote:
        lines.append(f"{inner}> {card.quote}")
    if card.table:
        lines.extend(table_lines(card.table, inner))
    lines.extend(f"{inner}{fold.label}: {fold.short}" for fold in card.folds if fold.kind != "text" or fold.table)
    for fix in card.fixes:
        said = f"{fix.verdict.label}: {fix.verdict.detail}" if fix.verdict else ""
        earlier = printed.get((fix.id, fix.code)) if printed is not None and fix.code.strip() else None
        seen = earlier is not None
        detail = fix.verdict.detail if fix.verdict and not (seen and earlier == said) else ""
        verdict = f" [{fix.verdict.label}{': ' + detail if detail else ''}]" if fix.verdict else ""
        lines.append(f"{inner}fix {fix.id}{': ' + fix.title if fix.title else ''}{verdict}"
                     + ("  (its cell is printed above)" if seen else ""))
        if not seen:
            lines.extend(f"{inner}    {row}" for row in fix.code.splitlines())
            if printed is not None:
                printed[fix.id, fix.code] = said
    lines.extend(f"{inner}{row}" for row in card.code.splitlines())
    return lines


def table_lines(table: Table, indent: str) -> list[str]:
    rows = [table.columns, *table.rows] if any(table.columns) else list(table.rows)
    widths = [min(max(len(str(row[i])) for row in rows), 48) for i in range(len(table.columns))]
    out = []
    for index, row in enumerate(rows):
        cells = [str(c).rjust(w) if i < len(table.numeric) and table.numeric[i] else str(c).ljust(w)
                 for i, (c, w) in enumerate(zip(row, widths))]
        out.append(indent + "  ".join(cells))
        if index == 0 and any(table.columns):
            out.append(indent + "  ".join("-" * w for w in widths))
    if table.note:
        out.append(indent + table.note)
    return out
