"""Small HTML fragments the widgets share (escaped; no scripts needed to read them)."""
from __future__ import annotations

import html
import json
from typing import Any

from ...document.outward import outward
from ...document.palette import GOOD_COLOR, SEVERITY_COLORS
from ...document.view import Verdict


def esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def badge(tone: str, text: str) -> str:
    color = SEVERITY_COLORS.get(tone, SEVERITY_COLORS["info"])
    return (f'<span style="background:{color};color:#fff;border-radius:3px;padding:1px 6px;'
            f'font-size:0.85em;font-weight:600">{esc(text)}</span>')


def verdict_badge(verdict: Verdict | None) -> str:
    """A fix's verification verdict beside its name: verified in green, not enough in red."""
    if verdict is None:
        return ""
    color = {"verified": GOOD_COLOR, "not-enough": SEVERITY_COLORS["error"]}.get(verdict.status, "#777")
    detail = f" <small>{esc(verdict.detail)}</small>" if verdict.detail else ""
    return f' <span style="color:{color};font-weight:600">[{esc(verdict.label)}]</span>{detail}'


def short(value: Any, limit: int = 300) -> str:
    """A live value (what a fix changed), redacted whole and then cut: the card is shared like a report."""
    value = outward(value)
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def failure(text: str) -> str:
    """A failed action, in the palette's error colour; redacted (an error can quote a secret)."""
    return f'<span style="color:{SEVERITY_COLORS["error"]}">{esc(outward(text))}</span>'


def success(html_text: str) -> str:
    return f'<div style="color:{GOOD_COLOR}">{html_text}</div>'


def code_block(code: str) -> str:
    return (f'<pre style="background:rgba(127,127,127,0.12);padding:6px;border-radius:3px;'
            f'white-space:pre-wrap;user-select:all">{esc(code)}</pre>')
