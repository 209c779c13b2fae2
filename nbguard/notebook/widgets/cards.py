"""Cards for audit findings and exception diagnoses, and the views that hold them.

A card shows severity, title, why (detail), the evidence in a collapsed Accordion, and one
:class:`FixRow` per fix. Only widget API common to ipywidgets 7.7 and 8 is used.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ipywidgets as W

from ...document.outward import outward
from ...document.view import Card, recommended_fix, view
from ...render.html import table_html
from .fixrow import ApplyFn, FixRow
from .html import badge, code_block, esc, short, success


def card_widget(card: Card, rows: list[FixRow], *, leads: bool = True) -> W.VBox:
    """A view card as widgets: the same words as the static HTML (``card_html``), with live fix rows.

    ``leads``: this card carries the output's recommended fix (``recommended_fix``), whose row (one Apply,
    one Insert) shows; every other row waits in a collapsed accordion, as the static HTML folds them."""
    head = W.HTML(value=(badge(card.tone, card.badge) + " " if card.badge else "")
                  + f"<b>{esc(card.title)}</b>" + (f" <code>{esc(card.tag)}</code>" if card.tag else ""))
    body = "".join(f"<div>{esc(line)}</div>" for line in card.lines)
    if card.quote:
        body += f"<div><code>{esc(card.quote)}</code></div>"
    if card.table:
        body += table_html(card.table)
    children: list[W.Widget] = [head, W.HTML(value=body)]
    if card.folds:
        accordion = W.Accordion(children=[  # evidence as its small table, exception texts as code
            W.HTML(value=table_html(fold.table) if fold.table is not None else code_block(fold.text))
            for fold in card.folds])
        for index, fold in enumerate(card.folds):
            accordion.set_title(index, fold.label.capitalize())
        accordion.selected_index = None  # collapsed until asked
        children.append(accordion)
    best = recommended_fix(card.fixes) if leads else None
    shown = [row for fix, row in zip(card.fixes, rows) if fix is best]
    folded = [row for row in rows if row not in shown]
    children.extend(row.widget for row in shown)
    if folded:
        others = W.Accordion(children=[W.VBox([row.widget for row in folded])])
        others.set_title(0, f"{len(folded)} {'other ' if shown else ''}fix{'es' if len(folded) > 1 else ''}")
        others.selected_index = None  # collapsed until asked
        children.append(others)
    # the badge carries the severity colour: Layout.border_left is ipywidgets 8 only (7.7 warns)
    return W.VBox(children, layout=W.Layout(border="1px solid #bbb", padding="6px", margin="4px 0"))


def fix_rows(card: Card, output_id: str, apply: ApplyFn | None) -> list[FixRow]:
    return [FixRow(fix.id, fix.title or fix.id, fix.code, output_id, apply, verdict=fix.verdict) for fix in card.fixes]


class FindingsView:
    """The audit's findings as cards; "Apply" re-runs the audit so a fixed finding disappears.

    ``rerun`` returns a fresh AuditResult for the same inputs; ``apply`` runs one fix;
    ``names`` are the user's variable names for fix code; ``on_change(result)`` lets the owner
    refresh the static copy of the output.
    """

    def __init__(self, result, output_id: str, *, rerun: Callable[[], Any], apply: ApplyFn,
                 names: dict[str, str], on_change: Callable[[Any], None] | None = None):
        self.result, self.output_id = result, output_id
        self._rerun, self._apply, self.names, self._on_change = rerun, apply, names, on_change
        self.resolved: list[str] = []  # rules that disappeared after a fix
        self.rows: dict[str, list[FixRow]] = {}
        self.header = W.HTML()
        self.cards = W.VBox()
        self.widget = W.VBox([self.header, self.cards])
        self.render()

    def render(self) -> None:
        v = view(outward(self.result.to_document(names=self.names)))  # a live card is shared like a report
        findings = v.section("findings")
        hardware = v.section("hardware")
        summary = (findings.facts[0].text if findings and findings.facts else "no findings")
        on = f" on {esc(hardware.facts[0].text)}" if hardware and hardware.facts else ""
        resolved = success("Fixed (gone after re-audit): " + ", ".join(f"<code>{esc(r)}</code>" for r in self.resolved)
                           ) if self.resolved else ""
        self.header.value = f"<b>nbguard precision audit</b>{on}: {esc(summary)}{resolved}"
        self.rows = {}
        children = []
        for index, card in enumerate(findings.cards if findings else []):
            rows = fix_rows(card, self.output_id, self._apply_and_reaudit)
            self.rows[card.tag] = rows
            children.append(card_widget(card, rows, leads=index == 0))  # the worst finding's fix is the story's
        self.cards.children = children

    def fix_row(self, rule: str, fix_id: str) -> FixRow:
        """The row of ``fix_id`` under the finding ``rule`` (for tests and scripted use)."""
        return next(row for row in self.rows[rule] if row.fix_id == fix_id)

    def _apply_and_reaudit(self, fix_id: str):
        changed, code = self._apply(fix_id)
        before = {f.rule for f in self.result.findings}
        self.result = self._rerun()
        after = {f.rule for f in self.result.findings}
        self.resolved += [rule for rule in before - after if rule not in self.resolved]
        applied_note = (changed, code)
        self.render()
        self._show_applied(fix_id, *applied_note)
        if self._on_change is not None:
            self._on_change(self.result)
        return applied_note

    def _show_applied(self, fix_id: str, changed, code: str) -> None:
        """After a re-render the fresh cards have no trace of the click: say it in the header."""
        self.header.value += (f"<div>Applied <code>{esc(fix_id)}</code>; changed: <code>{esc(short(changed, 600))}</code>"
                              f"</div>{code_block(code)}")


class DiagnosisView:
    """One diagnosis card under an exception's traceback."""

    def __init__(self, doc: dict, output_id: str, apply: ApplyFn | None):
        section = view(outward(doc)).section("diagnoses")
        if section is None or not section.cards:
            raise ValueError("DiagnosisView needs a document with one diagnosis")
        card = section.cards[0]
        card.fixes = [fix for fix in card.fixes if fix.code]  # only fixes with a cell to run
        self.rows = fix_rows(card, output_id, apply)
        self.widget = W.VBox([W.HTML(value="<b>nbguard diagnosis</b>"), card_widget(card, self.rows)])

    def fix_row(self, fix_id: str) -> FixRow:
        return next(row for row in self.rows if row.fix_id == fix_id)
