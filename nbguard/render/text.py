"""Plain-text rendering of a v1 document: the terminal, Colab's text fallback, ``print(result)``."""
from __future__ import annotations

import json
import math
import textwrap
import time
from collections.abc import Callable
from typing import Any

from .data import as_float, fmt_num, heading, history_overview, watch_sections

WIDTH = 100
MAX_PROBE_ROWS = 10
MAX_EVENTS = 20


def render_text(doc: dict) -> str:
    """A compact, readable text view of every section present in ``doc``."""
    if not isinstance(doc, dict):
        raise TypeError(f"doc must be an nbguard document (dict), got {type(doc).__name__}")
    lines: list[str] = [_header(doc)]
    for section in _SECTIONS:
        try:
            section(doc, lines)
        except Exception as exc:  # one odd section must not hide the rest
            lines.append(f"  (could not render {section.__name__.lstrip('_')}: {exc!r})")
    return "\n".join(line.rstrip() for line in lines).rstrip() + "\n"


def _header(doc: dict) -> str:
    return heading(doc) + f"  (nbguard {doc.get('nbguard_version', '?')}, schema v{doc.get('schema_version', '?')})"


def _wrap(text: Any, indent: str) -> list[str]:
    out: list[str] = []
    for para in str(text).splitlines() or [""]:
        out.extend(textwrap.wrap(para, WIDTH, initial_indent=indent, subsequent_indent=indent) or [indent])
    return out


def _short_json(value: Any, limit: int = 160) -> str:
    text = json.dumps(value, ensure_ascii=False, default=str) if not isinstance(value, str) else value
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _hardware(doc: dict, lines: list[str]) -> None:
    hw = doc.get("hardware")
    if isinstance(hw, dict):
        lines.append("Hardware: " + hardware_line(hw))


def hardware_line(hw: dict) -> str:
    parts = [str(hw.get("display_name") or hw.get("name") or "?")]
    cc = hw.get("compute_capability")
    if cc:
        parts.append("compute capability " + ".".join(str(c) for c in cc))
    if hw.get("memory_gb"):
        parts.append(f"{fmt_num(hw['memory_gb'])} GB")
    if "native_bf16" in hw:
        parts.append("native bf16" if hw["native_bf16"] else "no native bf16")
    if hw.get("detected") is not None:
        parts.append("detected" if hw.get("detected") else "profile")
    return ", ".join(parts)


def _findings(doc: dict, lines: list[str]) -> None:
    findings = doc.get("findings")
    if findings is None:
        return
    if not findings:
        lines.append("Findings: none (nothing to fix)")
        return
    counts: dict[str, int] = {}
    for f in findings:
        counts[str(f.get("severity"))] = counts.get(str(f.get("severity")), 0) + 1
    summary = ", ".join(f"{n} {sev}{'s' if n > 1 else ''}" for sev, n in counts.items())
    lines.append(f"Findings: {summary}")
    rank = {"error": 0, "warning": 1, "info": 2}
    for f in sorted(findings, key=lambda f: rank.get(f.get("severity"), 3)):
        lines.append(f"  [{str(f.get('severity', '?')).upper()}] {f.get('title', '')}  ({f.get('rule', '?')})")
        if f.get("detail"):
            lines.extend(_wrap(f["detail"], "      "))
        if f.get("evidence"):
            lines.append("      evidence: " + _short_json(f["evidence"]))
        if f.get("fixes"):
            lines.append("      fixes: " + ", ".join(str(x) for x in f["fixes"]))


def _probe(doc: dict, lines: list[str]) -> None:
    probe = doc.get("probe")
    if not isinstance(probe, dict):
        return
    modules = list(probe.get("modules") or [])
    limit = probe.get("limit", 65504.0)
    modules.sort(key=headroom_key)
    over = sum(1 for m in modules if headroom_key(m) < 1)
    lines.append(f"Activation probe (limit {fmt_num(limit)}): {len(modules)} modules, {over} at or over the limit")
    for m in modules[:MAX_PROBE_ROWS]:
        over_limit = headroom_key(m) < 1
        headroom = "overflow" if m.get("headroom") is None and over_limit else f"{fmt_num(m.get('headroom'), 3)}x"
        lines.append(f"  {str(m.get('module')):<48} {str(m.get('dtype', '')):<10} abs-max {fmt_num(m.get('absmax')):>10}"
                     f"  input {fmt_num(m.get('input_absmax')):>10}"
                     f"  headroom {headroom}{'  OVER LIMIT' if over_limit else ''}")
    if len(modules) > MAX_PROBE_ROWS:
        lines.append(f"  … {len(modules) - MAX_PROBE_ROWS} more")


def headroom_key(module: dict) -> float:
    """Sort key: least headroom first; an overflowed module (abs-max inf/nan) counts as 0."""
    headroom = as_float(module.get("headroom"))
    if headroom is not None and math.isfinite(headroom):
        return headroom
    absmax = as_float(module.get("absmax"))
    if absmax is not None and not math.isfinite(absmax):
        return 0.0
    return math.inf


def _watches(doc: dict, lines: list[str]) -> None:
    for watch in watch_sections(doc):
        events = watch["events"]
        overview = history_overview(watch["history"])
        head = f"Watch{': ' + str(watch['title']) if watch['title'] else ''}: {len(events)} event{'s' if len(events) != 1 else ''}"
        if overview:
            head += f" over {overview['n_steps']} steps"
            if overview["skipped_steps"]:
                head += f" ({len(overview['skipped_steps'])} skipped)"
        lines.append(head)
        for event in events[:MAX_EVENTS]:
            lines.extend(event_lines(event, "  "))
        if len(events) > MAX_EVENTS:
            lines.append(f"  … {len(events) - MAX_EVENTS} more events")
        if overview:
            lines.append("  " + history_line(overview))
        acts = watch["activations"]
        if isinstance(acts, dict):
            lines.append(f"  activation abs-max recorded for {len(acts.get('groups') or [])} groups x "
                         f"{len(acts.get('steps') or [])} steps (limit {fmt_num(acts.get('limit', 65504.0))})")


def event_lines(event: dict, indent: str) -> list[str]:
    cause = f" [{event.get('cause')}]" if event.get("cause") else ""
    out = [f"{indent}step {event.get('step')}: {event.get('kind')}{cause} {event.get('message', '')}"]
    for origin in event.get("origins") or []:
        out.append(f"{indent}    origin ({origin.get('phase')}): {origin_summary(origin)}")
    if event.get("evidence"):
        out.append(f"{indent}    evidence: {_short_json(event['evidence'])}")
    return out


def origin_summary(origin: dict) -> str:
    parts = [str(origin.get("module"))]
    if origin.get("tensor"):
        parts[0] += f" ({origin['tensor']})"
    if origin.get("dtype"):
        parts.append(str(origin["dtype"]))
    if origin.get("input_absmax") is not None:
        parts.append(f"input abs-max {fmt_num(origin['input_absmax'])}")
    if origin.get("output_absmax") is not None:
        parts.append(f"output abs-max {fmt_num(origin['output_absmax'])}")
    if origin.get("micro_batch") is not None:
        parts.append(f"micro-batch {origin['micro_batch']}")
    return ", ".join(parts)


def history_line(overview: dict) -> str:
    text = f"grad norms: {overview['n_groups']} groups x {overview['n_steps']} steps"
    if overview["n_steps"]:
        text += f" (steps {overview['first_step']}–{overview['last_step']})"
    if overview["first_nonfinite"]:
        step, group, value, count = overview["first_nonfinite"]
        text += f"; first non-finite: {value} at step {step} in {where_bad(group, count, overview['n_groups'])}"
    else:
        text += "; all finite"
    if overview["loss_first"] is not None:
        text += f"; loss {fmt_num(overview['loss_first'])} → {fmt_num(overview['loss_last'])}"
    if overview["nonfinite_loss_steps"]:
        text += f"; loss non-finite at {len(overview['nonfinite_loss_steps'])} steps"
    return text


def where_bad(group: str, count: int, total: int) -> str:
    """Where the first non-finite step hit: one group by name, or how many (all of them when
    the NaN spread through the backward pass)."""
    if count <= 1:
        return group
    return f"{'all ' if count == total else ''}{count} of {total} groups (first: {group})"


def _diagnoses(doc: dict, lines: list[str]) -> None:
    for diag in doc.get("diagnoses") or []:
        lines.append(f"Diagnosis: {diag.get('title', '')}  ({diag.get('signature', '?')})")
        if diag.get("detail"):
            lines.extend(_wrap(diag["detail"], "    "))
        if diag.get("exception"):
            lines.append("    exception: " + _short_json(last_line(diag["exception"])))
        if diag.get("fixes"):
            lines.append("    fixes: " + ", ".join(str(x) for x in diag["fixes"]))


def last_line(text: Any) -> str:
    """The last non-empty line of an exception text: the error message itself."""
    rows = [row for row in str(text).splitlines() if row.strip()]
    return rows[-1].strip() if rows else ""


def _fixes_applied(doc: dict, lines: list[str]) -> None:
    applied = doc.get("fixes_applied") or []
    if not applied:
        return
    lines.append(f"Fixes applied ({len(applied)}):")
    for item in applied:
        when = format_time(item.get("time"))
        lines.append(f"  {when} {item.get('fix')}: changed {_short_json(item.get('changed'), 100)}")
        for code_line in str(item.get("code") or "").splitlines():
            lines.append("      " + code_line)


def format_time(value: Any) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(value)))
    except (TypeError, ValueError, OverflowError, OSError):
        return str(value or "")


def _fix_cells(doc: dict, lines: list[str]) -> None:
    cells = doc.get("fix_cells")
    if not isinstance(cells, dict) or not cells:
        return
    lines.append("Fix cells:")
    for fix_id, cell in cells.items():
        cell = cell if isinstance(cell, dict) else {"code": str(cell)}
        lines.append(f"  # {fix_id}: {cell.get('title', '')}")
        for code_line in str(cell.get("code") or "").splitlines():
            lines.append("    " + code_line)


def _environment(doc: dict, lines: list[str]) -> None:
    env = doc.get("environment")
    if not isinstance(env, dict):
        return
    packages = env.get("packages") or {}
    pkg = ", ".join(f"{k} {v}" for k, v in packages.items() if k in _KEY_PACKAGES)
    text = f"Environment: Python {env.get('python', '?')} on {env.get('platform', '?')}"
    if env.get("torch_cuda"):
        text += f", CUDA {env['torch_cuda']}"
    lines.append(text)
    if pkg:
        lines.extend(_wrap(pkg, "  "))
    if isinstance(env.get("hardware"), dict) and not isinstance(doc.get("hardware"), dict):
        lines.append("  device: " + hardware_line(env["hardware"]))


_KEY_PACKAGES = ("torch", "transformers", "peft", "accelerate", "trl", "bitsandbytes", "unsloth")

def _notes(doc: dict, lines: list[str]) -> None:
    for note in doc.get("notes") or []:
        lines.append(f"Note: {note}")


_SECTIONS: list[Callable[[dict, list[str]], None]] = [
    _notes, _hardware, _findings, _probe, _watches, _diagnoses, _fixes_applied, _fix_cells, _environment,
]
