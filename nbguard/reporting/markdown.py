"""Markdown rendering of a report: fits a GitHub issue body.

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

from ..render.data import fmt_num, heading, history_overview, pretty_json, watch_sections
from ..render.text import format_time, hardware_line, headroom_key, last_line, origin_summary

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


def _json_block(value: Any, limit: int) -> str:
    text = pretty_json(value)
    if len(text) > limit:
        text = text[:limit] + "\n… (cut; the JSON report has all of it)"
    return md_fence(text, "json")


def render_markdown(doc: dict, *, images: dict[str, str] | None = None) -> str:
    """Markdown for ``doc``. ``images`` maps "heatmap-N" / "activations-N" (N = watch number,
    from 1) to a relative file name; heatmaps without one are left out with a note."""
    body = _render(doc, images or {}, compact=False)
    if len(body) > GITHUB_BODY_LIMIT - 1000:
        body = _render(doc, images or {}, compact=True)
    if len(body) > GITHUB_BODY_LIMIT - 200:
        body = body[: GITHUB_BODY_LIMIT - 400] + "\n\n> Cut to fit a GitHub issue; attach the JSON report for the rest.\n"
    return body


def _render(doc: dict, images: dict[str, str], compact: bool) -> str:
    limit = 400 if compact else 3000
    out: list[str] = []
    out.append(f"## {md_text(heading(doc))}")
    out.append(f"nbguard {md_text(doc.get('nbguard_version', '?'))} · schema v{md_text(doc.get('schema_version', '?'))}")
    for note in doc.get("notes") or []:
        out.append(f"> Note: {md_text(note)}")
    if isinstance(doc.get("hardware"), dict):
        out.append(f"**Hardware:** {md_text(hardware_line(doc['hardware']))}")

    findings = doc.get("findings")
    if isinstance(findings, list):
        out.append(f"### Findings ({len(findings)})")
        if not findings:
            out.append("No findings.")
        rank = {"error": 0, "warning": 1, "info": 2}
        for f in sorted(findings, key=lambda f: rank.get(f.get("severity"), 3)):
            line = f"- **{md_text(str(f.get('severity', '?')).upper())}** {md_text(f.get('title'))} ({md_code(f.get('rule'))})"
            if f.get("detail"):
                line += f": {md_text(f['detail'])}"
            if f.get("fixes"):
                line += " Fixes: " + ", ".join(md_code(x) for x in f["fixes"])
            out.append(line)
            if f.get("evidence") and not compact:
                out.append(details("evidence", _json_block(f["evidence"], limit)))

    probe = doc.get("probe")
    if isinstance(probe, dict):
        modules = sorted(probe.get("modules") or [], key=headroom_key)
        rows = modules[: 10 if compact else 25]
        over = sum(1 for m in modules if headroom_key(m) < 1)
        table = ["| module | dtype | abs-max | headroom |", "|---|---|---:|---:|"]
        for m in rows:
            bad = headroom_key(m) < 1
            headroom = "overflow" if m.get("headroom") is None and bad else f"{fmt_num(m.get('headroom'), 3)}×"
            table.append(f"| {md_code(m.get('module'))} | {md_code(m.get('dtype'))} | {md_text(fmt_num(m.get('absmax')))} | "
                         f"{'**' + md_text(headroom) + ' ⚠**' if bad else md_text(headroom)} |")
        more = f"\n\n{len(modules) - len(rows)} more modules with more headroom." if len(modules) > len(rows) else ""
        out.append(f"### Activation probe\nLimit {md_text(fmt_num(probe.get('limit', 65504.0)))}: {len(modules)} modules, "
                   f"**{over}** at or over the limit.")
        out.append(details("modules, least headroom first", "\n".join(table) + more))

    for number, watch in enumerate(watch_sections(doc), start=1):
        out.append("### Watch" + (f": {md_text(watch['title'])}" if watch["title"] else ""))
        overview = history_overview(watch["history"])
        if overview:
            out.append(_overview_md(overview))
        events = watch["events"]
        shown = events[: 10 if compact else 50]
        if events:
            table = ["| step | kind | cause | message | origins |", "|---:|---|---|---|---|"]
            for e in shown:
                origins = "<br>".join(f"{md_text(o.get('phase'))}: {md_code(origin_summary(o))}" for o in e.get("origins") or [])
                table.append(f"| {md_text(e.get('step'))} | {md_code(e.get('kind'))} | {md_text(e.get('cause') or '')} | "
                             f"{md_text(e.get('message'))} | {origins or '—'} |")
            if len(events) > len(shown):
                table.append(f"\n{len(events) - len(shown)} more events in the JSON report.")
            out.append(f"**Events ({len(events)})**\n\n" + "\n".join(table))
            if not compact:
                evidence = {f"step {e.get('step')} {e.get('kind')}": e.get("evidence") for e in shown if e.get("evidence")}
                if evidence:
                    out.append(details("event evidence", _json_block(evidence, limit)))
        else:
            out.append("No events.")
        for key, label in (("heatmap", "gradient-norm heatmap"), ("series", "loss and grad-norm plot"),
                           ("activations", "activation abs-max heatmap")):
            section = watch["activations"] if key == "activations" else watch["history"]
            if not isinstance(section, dict) or not section.get("steps"):
                continue
            name = images.get(f"{key}-{number}")
            if key == "series" and not name:
                continue  # optional picture: no note when it is not there
            if name:
                out.append(f"![{label}]({name})\n\n> The {label} is saved beside this file as {md_code(name)}: "
                           "drag it into the issue to attach it.")
            else:
                out.append(f"> The {label} is not included in Markdown; the HTML report embeds it.")

    diagnoses = doc.get("diagnoses") or []
    if diagnoses:
        out.append(f"### Explained exceptions ({len(diagnoses)})")
        for d in diagnoses:
            out.append(f"- **{md_text(d.get('title'))}** ({md_code(d.get('signature'))}): {md_text(d.get('detail') or '')}"
                       + (" Fixes: " + ", ".join(md_code(x) for x in d["fixes"]) if d.get("fixes") else ""))
            if d.get("exception"):
                exc = str(d["exception"])
                tail = exc if len(exc) <= limit else "…\n" + exc[-limit:]
                out.append(details(last_line(exc), md_fence(tail, "text")))

    applied = doc.get("fixes_applied") or []
    if applied:
        out.append(f"### Fixes applied ({len(applied)}, in order)")
        for i, item in enumerate(applied, start=1):
            out.append(f"{i}. {md_code(item.get('fix'))} at {md_text(format_time(item.get('time')))}\n\n"
                       + md_fence(item.get("code", ""), "python"))

    cells = doc.get("fix_cells")
    if isinstance(cells, dict) and cells and not compact:
        body = "\n\n".join(f"{md_code(k)} {md_text((v or {}).get('title', '') if isinstance(v, dict) else '')}\n\n"
                           + md_fence(v.get("code", "") if isinstance(v, dict) else v, "python") for k, v in cells.items())
        out.append(details("Fix cells", body))

    env = doc.get("environment")
    if isinstance(env, dict):
        rows = ["| | |", "|---|---|", f"| Python | {md_code(env.get('python'))} |", f"| Platform | {md_code(env.get('platform'))} |"]
        if env.get("torch_cuda"):
            rows.append(f"| torch CUDA | {md_code(env['torch_cuda'])} |")
        if isinstance(env.get("hardware"), dict):
            rows.append(f"| Device | {md_text(hardware_line(env['hardware']))} |")
        for name, version in (env.get("packages") or {}).items():
            rows.append(f"| {md_text(name)} | {md_code(version)} |")
        out.append(details("Environment", "\n".join(rows)))
    return "\n\n".join(out) + "\n"


def _overview_md(overview: dict) -> str:
    items = [f"{overview['n_groups']} module groups × {overview['n_steps']} steps"]
    if overview["first_nonfinite"]:
        step, group, value, count = overview["first_nonfinite"]
        where = md_code(group) if count <= 1 else (
            f"{'all ' if count == overview['n_groups'] else ''}{count} of {overview['n_groups']} groups (first: {md_code(group)})")
        items.append(f"**first non-finite gradient: {md_text(value)} at step {md_text(step)}** in {where}")
    elif overview["n_steps"]:
        items.append("all gradient norms finite")
    if overview["skipped_steps"]:
        skipped = overview["skipped_steps"]
        items.append(f"{len(skipped)} skipped: {md_text(', '.join(map(str, skipped[:20])) + (' …' if len(skipped) > 20 else ''))}")
    if overview["loss_first"] is not None:
        items.append(f"loss {md_text(fmt_num(overview['loss_first']))} → {md_text(fmt_num(overview['loss_last']))}")
    if overview["nonfinite_loss_steps"]:
        items.append(f"**loss non-finite at {len(overview['nonfinite_loss_steps'])} steps**")
    return "\n".join(f"- {item}" for item in items)
