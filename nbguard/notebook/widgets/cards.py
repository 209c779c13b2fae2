"""Cards for audit findings and exception diagnoses, and the views that hold them.

A card shows severity, title, why (detail), the evidence in a collapsed Accordion, and one
:class:`FixRow` per fix. Only widget API common to ipywidgets 7.7 and 8 is used.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ipywidgets as W

from .fixrow import ApplyFn, FixRow
from .html import badge, code_block, esc, table


def _evidence(evidence: dict[str, Any]) -> W.Accordion:
    accordion = W.Accordion(children=[W.HTML(value=table(evidence))])
    accordion.set_title(0, "Evidence")
    accordion.selected_index = None  # collapsed until asked
    return accordion


def card(severity: str, title: str, tag: str, detail: str, evidence: dict, fix_rows: list[FixRow],
         extra_html: str = "") -> W.VBox:
    head = W.HTML(value=f"{badge(severity)} <b>{esc(title)}</b> <code>{esc(tag)}</code>")
    why = W.HTML(value=f"<div>{esc(detail)}</div>{extra_html}")
    return W.VBox([head, why, _evidence(evidence), *[row.widget for row in fix_rows]],
                  layout=W.Layout(border="1px solid #bbb", padding="6px", margin="4px 0"))


def fix_rows(fix_ids: list[str], fix_cells: dict, output_id: str, apply: ApplyFn | None) -> list[FixRow]:
    rows = []
    for fix_id in fix_ids:
        cell = fix_cells.get(fix_id, {})
        rows.append(FixRow(fix_id, cell.get("title", fix_id), cell.get("code", ""), output_id, apply))
    return rows


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
        doc = self.result.to_document(names=self.names)
        findings = doc.get("findings", [])
        counts = {s: sum(f["severity"] == s for f in findings) for s in ("error", "warning", "info")}
        hw = doc.get("hardware", {}).get("display_name", "")
        summary = ", ".join(f"{n} {s}{'s' if n != 1 else ''}" for s, n in counts.items() if n) or "no findings"
        resolved = ""
        if self.resolved:
            resolved = ("<div style=\"color:#1A7F37\">Fixed (gone after re-audit): "
                        + ", ".join(f"<code>{esc(r)}</code>" for r in self.resolved) + "</div>")
        self.header.value = f"<b>nbguard precision audit</b> on {esc(hw)}: {esc(summary)}{resolved}"
        self.rows = {}
        children = []
        for finding in findings:
            rows = fix_rows(finding["fixes"], doc.get("fix_cells", {}), self.output_id, self._apply_and_reaudit)
            self.rows[finding["rule"]] = rows
            children.append(card(finding["severity"], finding["title"], finding["rule"], finding["detail"],
                                 finding.get("evidence", {}), rows))
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
        self.header.value += (f"<div>Applied <code>{esc(fix_id)}</code>; changed: <code>{esc(changed)}</code>"
                              f"</div>{code_block(code)}")


class DiagnosisView:
    """One diagnosis card under an exception's traceback."""

    def __init__(self, doc: dict, output_id: str, apply: ApplyFn | None):
        diagnosis = doc["diagnoses"][0]
        cells = doc.get("fix_cells", {})
        self.rows = fix_rows([f for f in diagnosis["fixes"] if f in cells], cells, output_id, apply)
        exception = f"<div><code>{esc(diagnosis['exception'])}</code></div>"
        self.widget = W.VBox([
            W.HTML(value="<b>nbguard diagnosis</b>"),
            card("error", diagnosis["title"], diagnosis["signature"], diagnosis["detail"],
                 diagnosis.get("evidence", {}), self.rows, extra_html=exception),
        ])

    def fix_row(self, fix_id: str) -> FixRow:
        return next(row for row in self.rows if row.fix_id == fix_id)
