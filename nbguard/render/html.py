"""Static HTML of a document: a formatter of :func:`nbguard.document.view.view`.

The fragment must read well in JupyterLab, Notebook 7, VS Code, Colab, nbconvert's HTML and
GitHub's notebook viewer (which strips <style>): so it is semantic HTML first (headings, tables,
<details>, <pre>), every state is spelled out in words as well as colour, and the scoped CSS only
refines it. Colours are translucent over ``currentColor`` so light and dark themes both work.
Every dynamic string goes through :func:`esc`.
"""
from __future__ import annotations

import base64
import html
from typing import Any

from ..document.palette import palette
from ..document.redact import redact
from ..document.view import Card, Chart, Fact, Fold, Section, Table, lookup, ranked, recommended_fix, view
from .charts import chart_png

CSS = """
.nbguard{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;font-size:13px;line-height:1.45;
 color:inherit;max-width:1100px}
.nbguard h2{font-size:16px;margin:.2em 0 .4em}
.nbguard h3{font-size:14px;margin:1em 0 .35em;border-bottom:1px solid rgba(128,128,128,.35);padding-bottom:2px}
.nbguard h4{font-size:13px;margin:.6em 0 .2em}
.nbguard h3.nbg-entry{font-size:15px;margin-top:1.6em;border-bottom:2px solid rgba(128,128,128,.6)}
.nbguard .nbg-meta{opacity:.7;font-size:12px;font-weight:normal}
.nbguard table{border-collapse:collapse;margin:.3em 0;font-size:12px}
.nbguard th,.nbguard td{border:1px solid rgba(128,128,128,.35);padding:2px 6px;text-align:left;vertical-align:top}
.nbguard th{background:rgba(128,128,128,.12)}
.nbguard td.num{text-align:right;font-variant-numeric:tabular-nums}
.nbguard pre{background:rgba(128,128,128,.12);padding:6px 8px;border-radius:4px;overflow-x:auto;
 white-space:pre-wrap;word-break:break-word;font-size:12px;margin:.3em 0}
.nbguard code{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace}
.nbguard .nbg-card{border:1px solid rgba(128,128,128,.35);border-left-width:5px;border-radius:4px;
 padding:4px 10px;margin:6px 0}
.nbguard .nbg-sev{font-weight:bold;font-size:11px;letter-spacing:.04em;padding:0 4px;border-radius:3px;
 border:1px solid currentColor}
.nbguard .nbg-bad{font-weight:bold;color:%(nan)s}
.nbguard .nbg-skip{font-style:italic;opacity:.8}
.nbguard img.nbg-heatmap{max-width:100%;height:auto;background:#fff;border-radius:4px;
 border:1px solid rgba(128,128,128,.35)}
.nbguard details{margin:.3em 0}
.nbguard summary{cursor:pointer}
.nbguard .nbg-note{opacity:.75;font-size:12px}
@media print{.nbguard details>*{display:block}.nbguard pre{white-space:pre-wrap}
 .nbguard .nbg-card,.nbguard table,.nbguard img{break-inside:avoid}}
"""

PAGE_CSS = """
body{margin:24px auto;max-width:1140px;padding:0 16px;background:#fff;color:#1b1b1b}
@media (prefers-color-scheme:dark){body{background:#1e1e1e;color:#e6e6e6}}
@media print{body{margin:0;max-width:none;background:#fff;color:#000}}
"""


def esc(value: Any) -> str:
    """Escape any value for HTML text and attribute context (quotes included)."""
    return html.escape("" if value is None else str(value), quote=True)


def _css() -> str:
    """The stylesheet, its colours from the one palette."""
    colors = palette()
    severity = "".join(f".nbguard .nbg-{name}{{border-left-color:{color}}}\n" for name, color in colors["severity"].items())
    return CSS.replace("%(nan)s", colors["nan"]) + severity


def render_html(doc: dict, *, standalone: bool = False, images: bool = True) -> str:
    """Static HTML for ``doc``: a fragment (``<div class="nbguard">``) or, with
    ``standalone=True``, a complete self-contained page (CSS inline, images as data URIs).

    ``images=False`` leaves the heatmaps out (used where PNGs are shipped separately). Redacted, as
    every renderer's output is.
    """
    doc = redact(doc)
    v = view(doc)
    drawn: set[tuple[str, str]] = set()  # each picture once: the story's heatmap is its watch's own

    def draw(chart: Chart) -> str:
        key = (chart.kind, repr(chart.source))
        if not images or (key in drawn and not chart.empty):
            return ""
        drawn.add(key)
        return _image(doc, chart)

    shown: set[tuple[str, str]] = set()  # each fix cell once: an event's card and its verification share it
    parts = [f'<div class="nbguard nbguard-{esc(doc.get("kind", "document"))}">', f"<style>{_css()}</style>",
             f'<h2>{esc(v.title)} <span class="nbg-meta">{esc(v.meta)}</span></h2>']
    if v.summary:
        parts.append(f"<p>{esc(v.summary)}</p>")
    parts.extend(section_html(section, draw, shown) for section in v.sections)
    parts.append("</div>")
    fragment = "\n".join(p for p in parts if p)
    if not standalone:
        return fragment
    # A saved report opens like the notebook: the story open; other fixes, evidence and every cell folded.
    return (
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
        "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
        f"<title>{esc(v.title)}</title>\n<style>{PAGE_CSS}</style>\n</head>\n<body>\n{fragment}\n</body>\n</html>\n"
    )


def styled(inner: str) -> str:
    """A piece of the view (a card, a table) with the stylesheet, for a widget to show on its own."""
    return f'<div class="nbguard"><style>{_css()}</style>{inner}</div>'


def png_data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def _details(summary: str, body: str) -> str:
    return f"<details><summary>{summary}</summary>{body}</details>"


def _pre(text: str) -> str:
    return f"<pre><code>{esc(text)}</code></pre>"


def _facts(facts: list[Fact]) -> str:
    tone = {"bad": "nbg-bad", "skip": "nbg-skip"}
    items = [f'<span class="{tone[f.tone]}">{esc(f.text)}</span>' if f.tone in tone else esc(f.text) for f in facts]
    if not items:
        return ""
    return f"<p>{items[0]}</p>" if len(items) == 1 else "<ul>" + "".join(f"<li>{i}</li>" for i in items) + "</ul>"


def table_html(table: Table) -> str:
    head = "".join(f"<th>{esc(c)}</th>" for c in table.columns) if any(table.columns) else ""
    rows = []
    for index, row in enumerate(table.rows):
        cells = []
        for col, value in enumerate(row):
            classes = [name for name, on in (("num", col < len(table.numeric) and table.numeric[col]),
                                             ("nbg-bad", index in table.bad_rows and col > 1)) if on]
            attr = f' class="{" ".join(classes)}"' if classes else ""
            text = f"<code>{esc(value)}</code>" if col < len(table.code) and table.code[col] and value else esc(value)
            tag = "th" if not any(table.columns) and col == 0 else "td"
            cells.append(f"<{tag}{attr}>{text}</{tag}>")
        rows.append(f"<tr>{''.join(cells)}</tr>")
    note = f'<p class="nbg-note">{esc(table.note)}</p>' if table.note else ""
    thead = f"<thead><tr>{head}</tr></thead>" if head else ""
    return f"<table>{thead}<tbody>{''.join(rows)}</tbody></table>{note}"


def _fold(fold: Fold) -> str:
    return _details(esc(fold.label), table_html(fold.table) if fold.table is not None else _pre(fold.text))


def _fix_html(fix, shown: set[tuple[str, str]] | None = None, lead: str = "fix") -> str:
    """A fix: its id, title and verdict; its cell folded, and only the first time that very cell appears."""
    verdict = (f' <span class="nbg-verdict nbg-verdict-{esc(fix.verdict.status)}">{esc(fix.verdict.label)}</span>'
               + (f' <span class="nbg-meta">{esc(fix.verdict.detail)}</span>' if fix.verdict.detail else "")
               if fix.verdict else "")
    label = f"{lead} <code>{esc(fix.id)}</code>" + (f": {esc(fix.title)}" if fix.title else "") + verdict
    key = (fix.id, fix.code)
    if not fix.code or (shown is not None and key in shown):
        return f"<p>{label}" + (' <span class="nbg-meta">(its cell is above)</span>' if fix.code else "") + "</p>"
    if shown is not None:
        shown.add(key)
    return f"<details><summary>{label}</summary>{_pre(fix.code)}</details>"


def _fixes_html(fixes: list, shown: set[tuple[str, str]] | None = None) -> str:
    """The fix ``recommended_fix`` picks (the one every face names) in one line, its cell a click away, the
    other fixes under one fold; it is called "recommended" once verified (an audit that ran nothing shows its
    first fix plainly). With fixes run and none verified, every fix waits under the fold."""
    if not fixes:
        return ""
    best = recommended_fix(fixes)
    others = [fix for fix in ranked(fixes) if fix is not best]
    verified = best is not None and best.verdict is not None  # a card names only a verified fix "recommended"
    first = _fix_html(best, shown, lead="recommended fix" if verified else "fix") if best is not None else ""
    if not others:
        return first
    label = (f"{len(others)} other fix{'es' if len(others) > 1 else ''}" if best is not None
             else f"{len(others)} fix{'es' if len(others) > 1 else ''}, none verified")
    return first + _details(label, "".join(_fix_html(fix, shown) for fix in others))


def card_html(card: Card, shown: set[tuple[str, str]] | None = None, *, detail_folded: bool = False) -> str:
    """A card; ``detail_folded``: its table and folds under one fold (a watch event, whose title says what and
    where), as the Lab draws it."""
    badge = f'<span class="nbg-sev">{esc(card.badge)}</span> ' if card.badge else ""
    tag = f' <code class="nbg-meta">{esc(card.tag)}</code>' if card.tag else ""
    body = [f"<p>{badge}<strong>{esc(card.title)}</strong>{tag}</p>"]
    body.extend(f"<p>{esc(line)}</p>" for line in card.lines)
    if card.quote:
        body.append(f"<p><code>{esc(card.quote)}</code></p>")
    detail = (table_html(card.table) if card.table else "") + "".join(_fold(fold) for fold in card.folds)
    if detail_folded and card.table:
        origins = len(card.table.rows)
        label = f"where it was born: {origins} origin{'' if origins == 1 else 's'}" + (" and evidence" if card.folds else "")
        body.append(_details(esc(label), detail))
    else:
        body.append(detail)
    body.append(_fixes_html(card.fixes, shown))
    if card.code:  # a fix applied: the cell that ran, folded, or a pointer to the same cell shown above
        key = (card.title, card.code)
        body.append('<p class="nbg-meta">the cell that ran is the one shown above</p>' if shown is not None and key in shown
                    else _details("the cell that ran", _pre(card.code)))
        if shown is not None:
            shown.add(key)
    return f'<div class="nbg-card nbg-{esc(card.tone)}">{"".join(body)}</div>'


def section_html(section: Section, draw, shown: set[tuple[str, str]] | None = None) -> str:
    if section.kind == "notes":
        return "".join(f'<p class="nbg-note">Note: {esc(note)}</p>' for note in section.notes)
    if section.kind == "entry":
        return f'<h3 class="nbg-entry">{esc(section.title)}</h3>'
    parts = [f"<h3>{esc(section.title)}</h3>" if section.title else ""]
    parts.append(_facts(section.facts))  # the environment's too: its one-line summary above the fold
    if section.table:
        table = table_html(section.table)
        parts.append(_details("details", table) if section.folded else table)
    if section.empty:
        parts.append(f"<p>{esc(section.empty)}</p>")
    if section.cards_title:
        parts.append(f"<h4>{esc(section.cards_title)}</h4>")
    parts.extend(_folded_card_html(card, shown) if is_fixes_run(card, section.kind)
                 else card_html(card, shown, detail_folded=section.kind == "watch") for card in section.cards)
    parts.extend(f'<p class="nbg-note">{esc(note)}</p>' for note in section.notes)
    parts.extend(draw(chart) for chart in section.charts)
    return "".join(parts)


def is_fixes_run(card: Card, section_kind: str) -> bool:
    """The card of the fixes a watch ran on an event's step (view.py, ``_event_cards``): its fixes, verdicts and
    proof are the event card's own, just above it; what it adds (each fix's measurements) is detail."""
    return section_kind == "watch" and card.tone == "info" and not card.fixes


def _folded_card_html(card: Card, shown: set[tuple[str, str]] | None) -> str:
    """A card one click away (issue 41: one screen), as the Lab draws it (labextension/src/render.ts)."""
    rows = len(card.table.rows) if card.table else 0
    label = f"{card.title}: each fix's verdict and measurements ({rows})" if rows else card.title
    return _details(esc(label), card_html(card, shown))


def _image(doc: dict, chart: Chart) -> str:
    if chart.empty:
        return f'<p class="nbg-note">{esc(chart.alt)}: {esc(chart.empty)}</p>'
    try:
        png = chart_png(chart.kind, lookup(doc, chart.source))
    except Exception as exc:  # matplotlib missing or data odd: say so, keep the rest
        return f'<p class="nbg-note">{esc(chart.alt)} not drawn: {esc(repr(exc))}</p>'
    if png is None:  # nothing to draw
        return ""
    return f'<p><img class="nbg-heatmap" alt="{esc(chart.alt)}" src="{png_data_uri(png)}"></p>'
