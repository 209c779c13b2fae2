"""Small HTML fragments the widgets share (escaped; no scripts needed to read them)."""
from __future__ import annotations

import html
import json
from typing import Any

SEVERITY_COLORS = {"error": "#B2182B", "warning": "#B35806", "info": "#2166AC"}  # readable on white and dark


def esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def badge(severity: str) -> str:
    color = SEVERITY_COLORS.get(severity, "#555")
    return (f'<span style="background:{color};color:#fff;border-radius:3px;padding:1px 6px;'
            f'font-size:0.85em;font-weight:600">{esc(severity.upper())}</span>')


def short(value: Any, limit: int = 300) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def table(rows: dict[str, Any]) -> str:
    if not rows:
        return "<em>no evidence recorded</em>"
    body = "".join(
        f'<tr><th style="text-align:left;padding-right:10px;vertical-align:top">{esc(k)}</th>'
        f'<td><code style="white-space:pre-wrap">{esc(short(v))}</code></td></tr>'
        for k, v in rows.items()
    )
    return f"<table>{body}</table>"


def code_block(code: str) -> str:
    return (f'<pre style="background:rgba(127,127,127,0.12);padding:6px;border-radius:3px;'
            f'white-space:pre-wrap;user-select:all">{esc(code)}</pre>')
