"""One fix under a finding or diagnosis: "Apply" and "Insert cell" buttons and what they did.

"Apply" runs the fix in the kernel (``nbguard.fixes.apply``) and shows what changed and the code
that was run. "Insert cell" asks the lab extension (over the comm) to put the fix code in a new
cell below this output; without the extension it shows the code to copy instead. A button
callback never calls ``set_next_input``: its payload only rides on an execute reply, which a
widget message does not have (``%nbguard fix ID`` does that from a cell).
"""
from __future__ import annotations

import html
from collections.abc import Callable
from typing import Any

import ipywidgets as W

from ...document.view import Verdict
from ..comm import CHANNEL
from .html import code_block, esc, failure, short, verdict_badge

ApplyFn = Callable[[str], tuple[Any, str]]  # fix id -> (what changed, the code that was run)


class FixRow:
    def __init__(self, fix_id: str, title: str, code: str, output_id: str, apply: ApplyFn | None,
                 verdict: Verdict | None = None):
        self.fix_id, self.title, self.code, self.output_id = fix_id, title, code, output_id
        self.verdict = verdict
        self._apply = apply
        self.applied: Any = None
        self.apply_button = W.Button(description="Apply", button_style="primary", tooltip=f"Run {fix_id} in the kernel")
        self.insert_button = W.Button(description="Insert cell", tooltip="Put the fix code in a new cell below")
        self.apply_button.on_click(lambda _b: self.apply())
        self.insert_button.on_click(lambda _b: self.insert())
        self.apply_button.disabled = apply is None
        self.result = W.HTML(value="")
        label = W.HTML(value=f"<b>Fix:</b> {esc(title)} <code>{esc(fix_id)}</code>{verdict_badge(verdict)}")
        self.widget = W.VBox([W.HBox([label, self.apply_button, self.insert_button]), self.result])

    def apply(self) -> None:
        """Run the fix; any error is shown in the row, never raised into the widget callback."""
        if self._apply is None:  # no kernel-side action here: the button is disabled
            return
        self.apply_button.disabled = True
        try:
            changed, code = self._apply(self.fix_id)
        except Exception as err:
            self.apply_button.disabled = False
            self.result.value = failure(f"Apply failed: {type(err).__name__}: {err}")
            return
        self.applied = changed
        self.apply_button.description = "Applied"
        self.result.value = (f"<div><b>Changed:</b> <code>{esc(short(changed, 600))}</code></div>"
                             f"<div>Code that was run (keep it in the notebook so a rerun repeats it):</div>"
                             f"{code_block(code)}")

    def insert(self) -> None:
        if CHANNEL.insert_cell(self.code, self.output_id, run=False, on_reply=self._on_reply):
            self.result.value = "<em>Inserting the cell below…</em>"
            return
        self.show_code()

    def show_code(self) -> None:
        """The fallback: the code to copy (selecting the block selects all of it), no script needed."""
        self.result.value = (
            f"{code_block(self.code)}"
            f"<div><small>The nbguard JupyterLab extension is not active here: click the code to select "
            f"it, copy it (Ctrl/Cmd+C) into a new cell, or run <code>%nbguard fix {esc(self.fix_id)}</code> "
            f"to get it as the next cell.</small></div>"
        )

    def _on_reply(self, reply: dict) -> None:
        if reply.get("action") == "inserted":
            where = reply.get("message") if reply.get("fallback") else "Inserted a cell below this output."
            self.result.value = f"<em>{html.escape(str(where))}</em>"
        else:
            self.show_code()
            self.result.value = failure(f"Insert failed: {reply.get('message')}") + self.result.value
