"""Markdown of a document, to paste into a GitHub issue: a formatter of :func:`nbguard.document.view.view`.

Long sections fold into ``<details>``; heatmaps are files saved beside the .md (GitHub cannot
read local files, so the text says to drag them in), or are left out with a note. Every dynamic
string is either inside a code span/fence or escaped, so module names such as ``<script>``
show as text. The body stays under GitHub's 65,536-character limit: if the full form is too
long, a compact form drops evidence and long lists (the JSON report keeps everything).
"""
from __future__ import annotations

import html
import re
from typing import Any

from ..document.view import Card, Section, Table, View, ranked, recommended_fix, view

GITHUB_BODY_LIMIT = 65536
_MD_SPECIAL = re.compile(r"([\\`*_\[\]|~])")  # what can change meaning mid-line


def md_text(value: Any) -> str:
    """Plain text safe in Markdown: HTML and Markdown syntax escaped, on one line."""
    text = str("" if value is None else value).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    text = _MD_SPECIAL.sub(r"\\\1", text)
    return " ".join(text.split())


def md_code(value: Any) -> str:
    """An inline code span that holds any text (backticks included); pipes escaped for tables."""
    text = " ".join(str("" if value is None else value).split())
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * (longest + 1)
    pad = " " if text.startswith("`") or text.endswith("`") or not text else ""
    return f"{fence}{pad}{text}{pad}{fence}".replace("|", "\\|")


def md_fence(text: Any, lang: str = "") -> str:
    text = str("" if text is None else text)
    longest = max((len(run) for run in re.findall(r"`{3,}", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}{lang}\n{text.rstrip()}\n{fence}"


def details(summary: str, body: str) -> str:
    """A folded section; ``summary`` is plain text (GitHub shows it as HTML, not Markdown)."""
    return f"<details><summary>{html.escape(summary)}</summary>\n\n{body}\n\n</details>"


def render_markdown(doc: dict, *, images: dict[str, str] | None = None) -> str:
    """Markdown for ``doc``. ``images`` maps "heatmap-N" / "series-N" / "activations-N" (N counts that
    kind of chart from 1, in view order) to a relative file name; heatmaps without one are left out
    with a note."""
    v = view(doc)
    body = _render(v, images or {}, compact=False)
    if len(body) > GITHUB_BODY_LIMIT - 1000:
        body = _render(v, images or {}, compact=True)
    if len(body) > GITHUB_BODY_LIMIT - 200:
        body = body[: GITHUB_BODY_LIMIT - 400] + ("\n\n> Cut to fit a GitHub issue; for the rest, save the report as .json "
                                                 "(`report.save('nbguard-report.json')`) and attach that.\n")
    return body


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + "\n… (cut; the document has all of it: to_document())"


def _render(v: View, images: dict[str, str], compact: bool) -> str:
    limit = 400 if compact else 3000
    out: list[str] = [f"## {md_text(v.title)}", md_text(v.meta)]
    if v.summary:
        out.append(md_text(v.summary))
    counters: dict[str, int] = {}
    for section in v.sections:
        out.extend(_section(section, images, counters, compact, limit))
    return "\n\n".join(part for part in out if part) + "\n"


def _table(table: Table, max_rows: int | None = None) -> str:
    rows = table.rows[:max_rows] if max_rows else table.rows
    columns = table.columns if any(table.columns) else ["", ""]
    lines = ["| " + " | ".join(md_text(c) for c in columns) + " |",
             "|" + "|".join("---:" if i < len(table.numeric) and table.numeric[i] else "---" for i in range(len(columns))) + "|"]
    for index, row in enumerate(rows):
        cells = [md_code(c) if i < len(table.code) and table.code[i] and c else md_text(c) for i, c in enumerate(row)]
        if index in table.bad_rows:
            cells[-1] = f"**{cells[-1]}**"
        lines.append("| " + " | ".join(cells) + " |")
    more = len(table.rows) - len(rows)
    note = table.note or (f"{more} more rows not shown; all of them are in the document (to_document())."
                          if more > 0 else "")
    return "\n".join(lines) + (f"\n\n{md_text(note)}" if note else "")


def _card(card: Card, compact: bool, limit: int) -> list[str]:
    head = f"- **{md_text(card.badge)}** " if card.badge else "- "
    line = head + md_text(card.title) + (f" ({md_code(card.tag)})" if card.tag else "")
    if card.lines:
        line += ": " + md_text(" ".join(card.lines))
    if card.fixes:  # the recommended one (the fix every face names) first, and marked
        best = recommended_fix(card.fixes)
        line += " Fixes: " + ", ".join(
            md_code(f.id) + (f" ({md_text(f.verdict.label)}{', recommended' if f is best else ''})" if f.verdict else "")
            for f in sorted(ranked(card.fixes), key=lambda f: f is not best))
    out = [line]
    if card.quote:
        out.append(f"  > {md_code(card.quote)}")
    if card.table:
        out.append(_table(card.table, 10 if compact else None))
    for fold in card.folds:
        if compact and (fold.kind == "json" or fold.table is not None):
            continue
        if fold.table is not None:
            out.append(details(fold.label, _table(fold.table)))
        elif fold.kind == "text":
            text = fold.text if len(fold.text) <= limit else "…\n" + fold.text[-limit:]
            out.append(details(fold.short or fold.label, md_fence(text, "text")))
        else:
            out.append(details(fold.label, md_fence(_cut(fold.text, limit), "json")))
    if card.code:  # a fix applied: the cell that ran, folded like every other cell
        out.append(details("the cell that ran", md_fence(card.code, "python")))
    return out


def _section(section: Section, images: dict[str, str], counters: dict[str, int], compact: bool, limit: int) -> list[str]:
    if section.kind == "notes":
        return [f"> Note: {md_text(note)}" for note in section.notes]
    if section.kind == "entry":
        return [f"### {md_text(section.title)}"]
    out = [f"#### {md_text(section.title)}" if section.title else ""]
    if section.empty:
        out.append(md_text(section.empty))
    if section.cards_title:
        out.append(f"**{md_text(section.cards_title)}**")
    if section.facts and section.kind != "environment":
        out.append("\n".join(f"- {'**' + md_text(f.text) + '**' if f.tone == 'bad' else md_text(f.text)}"
                             for f in section.facts))
    if section.table:
        table = _table(section.table, 10 if compact else 25)
        out.append(details(section.title, table) if section.folded or section.kind == "probe" else table)
    cards = section.cards[: 10 if compact else 50]
    for card in cards:
        out.extend(_card(card, compact, limit))
    if len(section.cards) > len(cards):
        out.append(f"{len(section.cards) - len(cards)} more {'events' if section.kind == 'watch' else 'items'} "
                   "not shown here; all of them are in the report's document (to_document(), or save it as .json).")
    out.extend(md_text(note) for note in section.notes)
    for chart in section.charts:
        if section.kind == "story":
            continue  # a first-screen copy of the watch's own heatmap, which the issue gets with its watch
        counters[chart.kind] = counters.get(chart.kind, 0) + 1
        name = images.get(f"{chart.kind}-{counters[chart.kind]}")
        if chart.empty:
            out.append(f"> The {chart.alt}: {md_text(chart.empty)}.")
        elif name:
            out.append(f"![{chart.alt}]({name})\n\n> The {chart.alt} is saved beside this file as {md_code(name)}: "
                       "drag it into the issue to attach it.")
        elif chart.kind != "series":  # the optional picture: no note when it is not there
            out.append(f"> The {chart.alt} is not included in Markdown; the HTML report embeds it.")
    return out
