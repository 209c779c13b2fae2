"""Plain text of a document: the terminal, Colab's text fallback, ``print(result)``.

A formatter of :func:`nbguard.document.view.view`: it decides layout only, never what is shown.
"""
from __future__ import annotations

import textwrap
from typing import Any

from ..document.redact import redact
from ..document.view import Card, Section, Table, View, view

WIDTH = 100
MAX_CARDS = 20


def render_text(doc: dict) -> str:
    """A compact, readable text view of every section present in ``doc``, redacted: ``print(result)``
    is pasted into bug reports like any saved output."""
    return format_view(view(redact(doc)))


def format_view(v: View) -> str:
    lines = [f"{v.title}  ({v.meta})"]
    if v.summary:
        lines.append(v.summary)
    printed: dict[tuple[str, str], str] = {}  # each fix cell once: an event's card and its verification share them
    for section in v.sections:
        lines.extend(section_lines(section, printed))
    return "\n".join(line.rstrip() for line in lines).rstrip() + "\n"


def _wrap(text: Any, indent: str) -> list[str]:
    out: list[str] = []
    for para in str(text).splitlines() or [""]:
        out.extend(textwrap.wrap(para, WIDTH, initial_indent=indent, subsequent_indent=indent) or [indent])
    return out


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
