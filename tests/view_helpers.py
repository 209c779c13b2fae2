"""Real nbguard results from planted faults on tiny models, one per kind of display: what the view,
schema and renderer tests check, and what ``labextension/scripts/make_fixtures.py`` writes as the
Lab extension's vitest fixtures (so Python and TypeScript test the same documents).
"""
from __future__ import annotations

import tempfile
from collections.abc import Callable
from functools import cache
from pathlib import Path

import torch
from audit_helpers import make_args, seed_peft_model
from report_helpers import _model_with_hostile_overflow, watched_run_with_planted_fault

import nbguard
import nbguard.fixes
from nbguard.auditor import AuditResult
from nbguard.document import MIME_TYPE
from nbguard.explainer.diagnosis import Diagnosis
from nbguard.reporting import Report
from nbguard.testing import tiny_batch, tiny_gemma3
from nbguard.watcher import NanWatch


def view_strings(view: dict) -> list[str]:
    """Every string a reader is shown from a view dict: what each renderer must show verbatim.

    (Chart sources, tones and column flags are layout, not words.)"""
    out = [view["title"], view["meta"], view["summary"]]

    def table(t: dict | None) -> None:
        if t:
            out.extend([*t["columns"], *(cell for row in t["rows"] for cell in row), t["note"]])

    for section in view["sections"]:
        out.extend([section["title"], section["empty"], section["cards_title"], *section["notes"]])
        out.extend(fact["text"] for fact in section["facts"])
        table(section["table"])
        for chart in section["charts"]:
            out.extend([chart["alt"], chart["empty"]])
        for card in section["cards"]:
            out.extend([card["title"], card["badge"], card["tag"], card["quote"], card["code"], *card["lines"]])
            table(card["table"])
            for fold in card["folds"]:  # a fold with a table shows its rows; its text is the same, aligned
                out.append(fold["label"])
                table(fold["table"]) if fold.get("table") else out.append(fold["text"])
            for fix in card["fixes"]:
                out.extend([fix["id"], fix["title"], fix["code"]])
                if fix["verdict"]:
                    out.extend([fix["verdict"]["label"], fix["verdict"]["detail"]])
    return [s for s in out if s]


def payload(result: AuditResult | NanWatch | Diagnosis | Report) -> dict:
    """What the notebook front end receives when ``result`` is displayed (document + view)."""
    return result._repr_mimebundle_()[MIME_TYPE]


def audit_with_errors_and_fix_cells() -> AuditResult:
    """A bf16 PEFT Gemma 3 with zero embedding rows, audited for a T4: bf16 unsupported (error),
    trainable bf16 parameters and untrained token rows (warnings), each with its fix cell."""
    return nbguard.audit(seed_peft_model(), hardware="t4")


def audit_with_probe() -> AuditResult:
    """fp16 training args on a T4, with the probe's forward pass over a tiny Llama whose layer-1
    down_proj (under a hostile module name) really overflows."""
    model, overflow = _model_with_hostile_overflow()
    overflow.armed = True
    with tempfile.TemporaryDirectory() as tmp:
        result = nbguard.audit(model, args=make_args(Path(tmp), fp16=True), hardware="t4",
                               batch=tiny_batch(2, 12), probe=True)
    overflow.armed = False
    return result


def watch_with_nan_origin(steps: int = 8, bad_step: int = 3) -> NanWatch:
    """A watch (policy "skip", activations recorded) over a tiny Llama whose planted module
    overflows on one step: a non-finite loss localised to its module, the step skipped."""
    return watched_run_with_planted_fault(steps, bad_step, policy="skip", activations=True)[1]


def watch_rewound(steps: int = 16, spike_at: int = 8) -> NanWatch:
    """A watch under policy rewind over a tiny Llama whose schedule puts the LR at 0.3 for two steps: the loss
    climbs, the watch rewinds to an earlier snapshot and cuts the LR (the history records the rewind)."""
    from nbguard.testing import tiny_batch, tiny_llama
    from nbguard.watcher import RewindSettings

    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 300.0 if s in (spike_at, spike_at + 1) else 1.0)
    watch = nbguard.watch(model, optimizer=opt, policy="rewind", verify=False, scheduler=sched,
                          rewind=RewindSettings(every=2))
    batch = tiny_batch()
    for _ in range(steps):
        opt.zero_grad()
        model(**batch).loss.backward()
        opt.step()
        sched.step()
    watch.detach()
    return watch


def diagnosis_of_real_exception() -> Diagnosis:
    """The exception torch really raises on a float32 x bfloat16 linear, explained."""
    try:
        torch.nn.functional.linear(torch.randn(2, 3), torch.randn(4, 3).to(torch.bfloat16))
    except RuntimeError as exc:
        diagnosis = nbguard.explain(exc)
    else:  # pragma: no cover - torch changed
        raise RuntimeError("torch no longer raises on a float32 x bfloat16 linear: pick another real exception")
    if diagnosis is None:
        raise RuntimeError("nbguard.explain did not recognise torch's float32 x bfloat16 mismatch")
    return diagnosis


def session_report() -> Report:
    """The session story: the runs above plus an audit, a fix applied and the audit after it."""
    model = seed_peft_model()
    nbguard.audit(model, hardware="a100")
    nbguard.fixes.apply("upcast-trainable-fp32", model=model)
    nbguard.audit(model, hardware="a100")
    return nbguard.report()


def healthy_audit() -> AuditResult:
    """A passing audit: no findings."""
    return nbguard.audit(tiny_gemma3(), hardware="a100")


RESULTS: dict[str, Callable[[], object]] = {
    "audit": audit_with_errors_and_fix_cells,
    "probe": audit_with_probe,
    "watch": watch_with_nan_origin,
    "diagnosis": diagnosis_of_real_exception,
    "healthy": healthy_audit,
    "report": session_report,  # the session then holds every run above
    "rewound": watch_rewound,  # after the report: its story stays that of the runs above
}


@cache
def real_payloads() -> dict[str, dict]:
    """Every result above as displayed, built once per process (the report last: it tells the
    story of the others). Callers must not mutate the payloads."""
    from nbguard.session import SESSION

    SESSION.clear()  # the report holds exactly the runs above
    torch.manual_seed(0)
    return {name: payload(make()) for name, make in RESULTS.items()}
