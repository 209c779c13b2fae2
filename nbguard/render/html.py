"""Static HTML rendering of a v1 document.

The fragment must read well in JupyterLab, Notebook 7, VS Code, Colab, nbconvert's HTML and
GitHub's notebook viewer (which strips <style>): so it is semantic HTML first (headings, tables,
<details>, <pre>), every state is spelled out in words as well as colour, and the scoped CSS only
refines it. Colours are translucent over ``currentColor`` so light and dark themes both work.
Every dynamic string goes through :func:`esc`.
"""
from __future__ import annotations

import base64
import html
import json
from collections.abc import Callable
from typing import Any

from .data import fmt_num, heading, history_overview, pretty_json, watch_sections
from .text import format_time, hardware_line, headroom_key, last_line

MAX_PROBE_ROWS = 40
MAX_EVENTS = 100

CSS = """
.nbguard{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;font-size:13px;line-height:1.45;
 color:inherit;max-width:1100px}
.nbguard h2{font-size:16px;margin:.2em 0 .4em}
.nbguard h3{font-size:14px;margin:1em 0 .35em;border-bottom:1px solid rgba(128,128,128,.35);padding-bottom:2px}
.nbguard h4{font-size:13px;margin:.6em 0 .2em}
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
.nbguard .nbg-error{border-left-color:#D55E00}
.nbguard .nbg-warning{border-left-color:#E69F00}
.nbguard .nbg-info{border-left-color:#0072B2}
.nbguard .nbg-sev{font-weight:bold;font-size:11px;letter-spacing:.04em;padding:0 4px;border-radius:3px;
 border:1px solid currentColor}
.nbguard .nbg-bad{font-weight:bold;color:#D55E00}
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


def render_html(doc: dict, *, standalone: bool = False, images: bool = True) -> str:
    """Static HTML for ``doc``: a fragment (``<div class="nbguard">``) or, with
    ``standalone=True``, a complete self-contained page (CSS inline, images as data URIs).

    ``images=False`` leaves the heatmaps out (used where PNGs are shipped separately).
    """
    if not isinstance(doc, dict):
        raise TypeError(f"doc must be an nbguard document (dict), got {type(doc).__name__}")
    parts = [f'<div class="nbguard nbguard-{esc(doc.get("kind", "document"))}">', f"<style>{CSS}</style>",
             _header(doc)]
    for section in _SECTIONS:
        try:
            parts.append(section(doc, images))
        except Exception as exc:  # one odd section must not hide the rest
            parts.append(f'<p class="nbg-note">could not render {esc(section.__name__.lstrip("_"))}: {esc(repr(exc))}</p>')
    parts.append("</div>")
    fragment = "\n".join(p for p in parts if p)
    if not standalone:
        return fragment
    # A saved report opens every fold: printing shows closed <details> empty, and no script may
    # open them. (Dynamic text is escaped, so only our own tags match.)
    fragment = fragment.replace("<details>", "<details open>")
    title = esc(heading(doc))
    return (
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
        "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
        f"<title>{title}</title>\n<style>{PAGE_CSS}</style>\n</head>\n<body>\n{fragment}\n</body>\n</html>\n"
    )


def png_data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def _header(doc: dict) -> str:
    name = esc(heading(doc))
    meta = f"nbguard {esc(doc.get('nbguard_version', '?'))} · schema v{esc(doc.get('schema_version', '?'))}"
    return f'<h2>{name} <span class="nbg-meta">{meta}</span></h2>' + _summary(doc)


def _summary(doc: dict) -> str:
    """One line that says whether anything is wrong, before any detail."""
    bits = []
    findings = doc.get("findings")
    if isinstance(findings, list):
        errors = sum(1 for f in findings if f.get("severity") == "error")
        warnings = sum(1 for f in findings if f.get("severity") == "warning")
        bits.append(f"{len(findings)} finding{'s' if len(findings) != 1 else ''} ({errors} error, {warnings} warning)")
    watches = list(watch_sections(doc))
    if watches:
        n_events = sum(len(w["events"]) for w in watches)
        bits.append(f"{n_events} watch event{'s' if n_events != 1 else ''}")
    if doc.get("diagnoses"):
        bits.append(f"{len(doc['diagnoses'])} explained exception{'s' if len(doc['diagnoses']) != 1 else ''}")
    if doc.get("fixes_applied"):
        bits.append(f"{len(doc['fixes_applied'])} fix{'es' if len(doc['fixes_applied']) != 1 else ''} applied")
    return f"<p>{esc(' · '.join(bits))}</p>" if bits else ""


def _json_pre(value: Any) -> str:
    return f"<pre><code>{esc(pretty_json(value))}</code></pre>"


def _details(summary: str, body: str, open_: bool = False) -> str:
    return f"<details{' open' if open_ else ''}><summary>{summary}</summary>{body}</details>"


def _hardware(doc: dict, images: bool) -> str:
    hw = doc.get("hardware")
    if not isinstance(hw, dict):
        return ""
    return f"<p><strong>Hardware:</strong> {esc(hardware_line(hw))}</p>"


def _code_block(code: Any) -> str:
    return f"<pre><code>{esc(code)}</code></pre>"


def _findings(doc: dict, images: bool) -> str:
    findings = doc.get("findings")
    if findings is None:
        return ""
    if not findings:
        return "<h3>Findings</h3><p>No findings: nothing to fix.</p>"
    cells = doc.get("fix_cells") if isinstance(doc.get("fix_cells"), dict) else {}
    rank = {"error": 0, "warning": 1, "info": 2}
    out = [f"<h3>Findings ({len(findings)})</h3>"]
    for f in sorted(findings, key=lambda f: rank.get(f.get("severity"), 3)):
        sev = str(f.get("severity", "info"))
        sev_class = sev if sev in rank else "info"
        body = [f'<p><span class="nbg-sev">{esc(sev.upper())}</span> <strong>{esc(f.get("title", ""))}</strong> '
                f'<code class="nbg-meta">{esc(f.get("rule", ""))}</code></p>']
        if f.get("detail"):
            body.append(f"<p>{esc(f['detail'])}</p>")
        if f.get("evidence"):
            body.append(_details("evidence", _json_pre(f["evidence"])))
        body.extend(_fix_blocks(f.get("fixes"), cells))
        out.append(f'<div class="nbg-card nbg-{sev_class}">{"".join(body)}</div>')
    return "".join(out)


def _fix_blocks(fix_ids, cells: dict) -> list[str]:
    """Each fix a card offers: its cell, folded, when the document carries one; else just its id."""
    blocks = []
    for fix_id in fix_ids or []:
        cell = cells.get(fix_id) if isinstance(cells.get(fix_id), dict) else None
        if cell:
            blocks.append(_details(f"fix <code>{esc(fix_id)}</code>: {esc(cell.get('title', ''))}",
                                   _code_block(cell.get("code", ""))))
        else:
            blocks.append(f"<p>fix: <code>{esc(fix_id)}</code></p>")
    return blocks


def _probe(doc: dict, images: bool) -> str:
    probe = doc.get("probe")
    if not isinstance(probe, dict):
        return ""
    modules = sorted(probe.get("modules") or [], key=headroom_key)
    limit = probe.get("limit", 65504.0)
    over = sum(1 for m in modules if headroom_key(m) < 1)
    rows = []
    for m in modules[:MAX_PROBE_ROWS]:
        bad = headroom_key(m) < 1
        mark = ' class="num nbg-bad"' if bad else ' class="num"'
        headroom = "overflow" if m.get("headroom") is None and bad else f"{fmt_num(m.get('headroom'), 3)}×"
        flag = " ⚠ over limit" if bad else ""
        rows.append(f"<tr><td><code>{esc(m.get('module'))}</code></td><td>{esc(m.get('dtype', ''))}</td>"
                    f"<td{mark}>{esc(fmt_num(m.get('absmax')))}</td>"
                    f"<td{mark}>{esc(fmt_num(m.get('input_absmax')))}</td>"
                    f"<td{mark}>{esc(headroom + flag)}</td></tr>")
    more = (f'<p class="nbg-note">{len(modules) - MAX_PROBE_ROWS} more modules with more headroom not shown.</p>'
            if len(modules) > MAX_PROBE_ROWS else "")
    table = ("<table><thead><tr><th>module</th><th>dtype</th><th>output abs-max</th><th>input abs-max</th>"
             "<th>headroom</th></tr></thead>"
             f"<tbody>{''.join(rows)}</tbody></table>{more}")
    return (f"<h3>Activation probe</h3><p>Limit {esc(fmt_num(limit))}: {len(modules)} modules, "
            f"<strong>{over}</strong> at or over the limit (least headroom first).</p>" + table)


def _watches(doc: dict, images: bool) -> str:
    out = []
    for watch in watch_sections(doc):
        title = "Watch" + (f": {esc(watch['title'])}" if watch["title"] else "")
        out.append(f"<h3>{title}</h3>")
        history = watch["history"]
        overview = history_overview(history)
        if overview:
            out.append(_history_summary(overview))
        out.append(_events(watch["events"]))
        if isinstance(history, dict) and images and overview.get("n_steps") and overview.get("n_groups"):
            out.append(_image(lambda history=history: _heatmap(history), "gradient-norm heatmap"))
        if isinstance(history, dict) and images and overview.get("n_steps"):
            out.append(_image(lambda history=history: _series(history), SERIES_ALT))
        acts = watch["activations"]
        if isinstance(acts, dict) and images and acts.get("steps") and acts.get("groups"):
            out.append(_image(lambda acts=acts: _activations(acts), "activation abs-max heatmap"))
    return "".join(out)


def _heatmap(history: dict) -> bytes:
    from .heatmap import heatmap_png

    return heatmap_png(history)


SERIES_ALT = "loss, total grad norm and loss scale per step"


def _series(history: dict) -> bytes | None:
    from .series import series_png

    return series_png(history)


def _activations(acts: dict) -> bytes:
    from .heatmap import activations_png

    return activations_png(acts)


def _image(make: Callable[[], bytes | None], alt: str) -> str:
    try:
        png = make()
    except Exception as exc:  # matplotlib missing or data odd: say so, keep the rest
        return f'<p class="nbg-note">{esc(alt)} not drawn: {esc(repr(exc))}</p>'
    if png is None:  # nothing to draw
        return ""
    return f'<p><img class="nbg-heatmap" alt="{esc(alt)}" src="{png_data_uri(png)}"></p>'


def _history_summary(overview: dict) -> str:
    items = [f"{overview['n_groups']} module groups × {overview['n_steps']} steps"
             + (f" (steps {esc(overview['first_step'])}–{esc(overview['last_step'])})" if overview["n_steps"] else "")]
    if overview["first_nonfinite"]:
        step, group, value, count = overview["first_nonfinite"]
        where = (f"<code>{esc(group)}</code>" if count <= 1 else
                 f"{'all ' if count == overview['n_groups'] else ''}{count} of {overview['n_groups']} groups "
                 f"(first: <code>{esc(group)}</code>)")
        items.append(f'<span class="nbg-bad">first non-finite gradient: {esc(value)} at step {esc(step)} '
                     f'in {where}</span> ({overview["nonfinite_cells"]} non-finite cells in all)')
    elif overview["n_steps"]:
        items.append("all gradient norms finite")
    skipped = overview["skipped_steps"]
    if skipped:
        shown = ", ".join(str(s) for s in skipped[:20]) + (" …" if len(skipped) > 20 else "")
        items.append(f'<span class="nbg-skip">{len(skipped)} skipped step{"s" if len(skipped) != 1 else ""}: {esc(shown)}</span>')
    if overview["loss_first"] is not None:
        items.append(f"loss {esc(fmt_num(overview['loss_first']))} → {esc(fmt_num(overview['loss_last']))}")
    if overview["nonfinite_loss_steps"]:
        items.append(f'<span class="nbg-bad">loss non-finite at {len(overview["nonfinite_loss_steps"])} steps</span>')
    return "<ul>" + "".join(f"<li>{item}</li>" for item in items) + "</ul>"


def _events(events: list) -> str:
    if not events:
        return "<p>No events.</p>"
    out = [f"<h4>Events ({len(events)})</h4>"]
    for event in events[:MAX_EVENTS]:
        cause = f" — cause: <strong>{esc(event.get('cause'))}</strong>" if event.get("cause") else ""
        body = [f"<p><strong>step {esc(event.get('step'))}</strong> · <code>{esc(event.get('kind'))}</code>{cause}"
                f"<br>{esc(event.get('message', ''))}</p>"]
        origins = event.get("origins") or []
        if origins:
            rows = "".join(
                f"<tr><td>{esc(o.get('phase'))}</td><td><code>{esc(o.get('module'))}</code></td>"
                f"<td>{esc(o.get('tensor') or '')}</td><td>{esc(o.get('dtype') or '')}</td>"
                f"<td class=\"num\">{esc(fmt_num(o.get('input_absmax')))}</td>"
                f"<td class=\"num\">{esc(fmt_num(o.get('output_absmax')))}</td>"
                f"<td class=\"num\">{esc('' if o.get('micro_batch') is None else o.get('micro_batch'))}</td></tr>"
                + (f"<tr><td></td><td colspan=\"6\">{_details('origin evidence', _json_pre(o['evidence']))}</td></tr>"
                   if o.get("evidence") else "")
                for o in origins
            )
            body.append("<table><thead><tr><th>phase</th><th>origin module</th><th>tensor</th><th>dtype</th>"
                        "<th>input abs-max</th><th>output abs-max</th><th>micro-batch</th></tr></thead>"
                        f"<tbody>{rows}</tbody></table>")
        if event.get("evidence"):
            body.append(_details("evidence", _json_pre(event["evidence"])))
        severity = "error" if str(event.get("kind", "")).startswith("nonfinite") else "warning"
        out.append(f'<div class="nbg-card nbg-{severity}">{"".join(body)}</div>')
    if len(events) > MAX_EVENTS:
        out.append(f'<p class="nbg-note">{len(events) - MAX_EVENTS} more events not shown (all are in the JSON).</p>')
    return "".join(out)


def _diagnoses(doc: dict, images: bool) -> str:
    diagnoses = doc.get("diagnoses") or []
    if not diagnoses:
        return ""
    cells = doc.get("fix_cells") if isinstance(doc.get("fix_cells"), dict) else {}
    out = [f"<h3>Explained exceptions ({len(diagnoses)})</h3>"]
    for d in diagnoses:
        body = [f"<p><strong>{esc(d.get('title', ''))}</strong> <code class=\"nbg-meta\">{esc(d.get('signature', ''))}</code></p>"]
        if d.get("detail"):
            body.append(f"<p>{esc(d['detail'])}</p>")
        if d.get("exception"):
            body.append(f"<p><code>{esc(last_line(d['exception']))}</code></p>")
            body.append(_details("exception text", _code_block(d["exception"])))
        if d.get("evidence"):
            body.append(_details("evidence", _json_pre(d["evidence"])))
        body.extend(_fix_blocks(d.get("fixes"), cells))
        out.append(f'<div class="nbg-card nbg-error">{"".join(body)}</div>')
    return "".join(out)


def _fixes_applied(doc: dict, images: bool) -> str:
    applied = doc.get("fixes_applied") or []
    if not applied:
        return ""
    out = [f"<h3>Fixes applied ({len(applied)}, in order)</h3><ol>"]
    for item in applied:
        changed = item.get("changed")
        out.append(f"<li><code>{esc(item.get('fix'))}</code> <span class=\"nbg-meta\">{esc(format_time(item.get('time')))}</span>"
                   + (_details("what changed", _json_pre(changed)) if changed not in (None, "", [], {}) else "")
                   + _code_block(item.get("code", "")) + "</li>")
    out.append("</ol>")
    return "".join(out)


def _fix_cells(doc: dict, images: bool) -> str:
    cells = doc.get("fix_cells")
    if not isinstance(cells, dict) or not cells:
        return ""
    referenced = {fid for f in doc.get("findings") or [] for fid in f.get("fixes") or []}
    referenced |= {fid for d in doc.get("diagnoses") or [] for fid in d.get("fixes") or []}
    loose = {k: v for k, v in cells.items() if k not in referenced}
    if not loose:
        return ""  # already shown under their findings / diagnoses
    out = ["<h3>Fix cells</h3>"]
    for fix_id, cell in loose.items():
        cell = cell if isinstance(cell, dict) else {"code": str(cell)}
        out.append(f"<h4><code>{esc(fix_id)}</code> {esc(cell.get('title', ''))}</h4>{_code_block(cell.get('code', ''))}")
    return "".join(out)


def _environment(doc: dict, images: bool) -> str:
    env = doc.get("environment")
    if not isinstance(env, dict):
        return ""
    rows = [("Python", env.get("python")), ("Platform", env.get("platform")), ("torch CUDA", env.get("torch_cuda"))]
    if isinstance(env.get("hardware"), dict):
        rows.append(("Device", hardware_line(env["hardware"])))
    for name, version in (env.get("packages") or {}).items():
        rows.append((name, version))
    for key, value in env.items():
        if key not in ("python", "platform", "torch_cuda", "hardware", "packages"):
            rows.append((key, value if isinstance(value, str) else json.dumps(value, default=str)))
    body = "<table><tbody>" + "".join(
        f"<tr><th>{esc(k)}</th><td>{esc('—' if v is None else v)}</td></tr>" for k, v in rows) + "</tbody></table>"
    return "<h3>Environment</h3>" + _details("Python, platform, library versions", body)


def _notes(doc: dict, images: bool) -> str:
    notes = doc.get("notes") or []
    return "".join(f'<p class="nbg-note">Note: {esc(note)}</p>' for note in notes)


_SECTIONS: list[Callable[[dict, bool], str]] = [
    _notes, _hardware, _findings, _probe, _watches, _diagnoses, _fixes_applied, _fix_cells, _environment,
]
