"""What the guides say is what the code does: every Python block in README.md and docs/**/*.md runs here
(with tiny real objects for the names it uses), the API signatures they quote match the real functions,
the notebooks they list are those in notebooks/, and the install guide's "imported only when you audit or
watch their objects" holds in a fresh interpreter."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from notebook_helpers import shell  # noqa: F401  (the fixture)

REPO = Path(__file__).resolve().parent.parent


def _run_fresh(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env=env)


def test_plain_pytorch_imports_no_transformers_peft_or_accelerate():
    """docs/install.md: "transformers, peft and accelerate are imported only when you audit or watch their
    objects". An audit, a watch that catches and localises a NaN, its text view and a report, all on an
    nn.Sequential, leave the three unimported; a Trainer is still recognised once transformers is in use."""
    result = _run_fresh("""
        import sys, torch, nbguard

        def loaded():
            return [name for name in ("transformers", "peft", "accelerate") if name in sys.modules]

        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        audit = nbguard.audit(model, hardware="t4")
        with nbguard.watch(model, optimizer=optimizer, policy="skip") as watch:
            for step in range(3):
                x = torch.randn(3, 4)
                if step == 1:
                    x[0, 0] = float("nan")
                model(x).pow(2).mean().backward()
                optimizer.step()
                optimizer.zero_grad()
        assert [event.kind for event in watch.events] == ["nonfinite-grad"], watch.events
        str(watch)
        nbguard.report(audit=audit, watch=watch).to_html()
        print("LOADED", loaded())
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "LOADED []" in result.stdout, result.stdout[-2000:]


def test_a_trainer_is_still_recognised_without_importing_transformers_for_plain_models():
    import transformers
    import transformers.trainer  # noqa: F401  (what defining or importing any Trainer does)

    from nbguard.watcher.watch import _is_trainer

    class Sub(transformers.Trainer):  # a TRL-style subclass
        def __init__(self):
            pass

    assert _is_trainer(Sub()) and not _is_trainer(object())


# -- %nanwatch off: what its manual says ---------------------------------------------------------
PLAIN_LOOP_SETUP = """
import torch
net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
opt = torch.optim.SGD(net.parameters(), lr=0.1)
"""
PLAIN_STEPS = """
for _ in range(2):
    opt.zero_grad()
    net(torch.randn(3, 4)).pow(2).mean().backward()
    opt.step()
"""


def _hooks(model) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in model.modules())


def test_nanwatch_off_detaches_the_line_magics_watch_and_a_cell_detaches_its_own(shell):
    """The manual: "'off' (line magic only) detaches the watch a line %nanwatch started (a %%nanwatch cell
    detaches its own when the cell ends)"."""
    from notebook_helpers import run, usage_line

    from nbguard.notebook.magics import NbguardMagics
    from nbguard.watcher.watch import attached_watches

    assert "a %%nanwatch cell detaches its own when the cell ends" in " ".join(NbguardMagics.nanwatch.__doc__.split())
    run(shell, PLAIN_LOOP_SETUP)
    net = shell.user_ns["net"]
    before = _hooks(net)
    cell = run(shell, "%%nanwatch net\n" + PLAIN_STEPS)
    assert cell.error is None, cell.stderr
    assert _hooks(net) == before and attached_watches() == []  # the cell's watch is gone with the cell
    assert usage_line(run(shell, "%nanwatch off")).startswith("nbguard: no watch")  # nothing left for off
    run(shell, "%nanwatch net")
    assert _hooks(net) > before and len(attached_watches()) == 1
    run(shell, PLAIN_STEPS)
    cell = run(shell, "%nanwatch off")
    assert cell.error is None and _hooks(net) == before and attached_watches() == []


# -- the views say only what is true: names as written, each cell once, no pointer to an unwritten file ----------
def _folds(view, label):
    return [fold for section in view.sections for card in section.cards for fold in card.folds if fold.label == label]


def test_what_a_real_fix_changed_keeps_parameter_names_and_points_at_the_document(tmp_path):
    import torch

    import nbguard
    from nbguard.document.view import MAX_EVIDENCE_ROWS, view
    from nbguard.testing import tiny_llama

    applied = nbguard.fixes.apply("upcast-trainable-fp32", model=tiny_llama(dtype=torch.float16))
    assert "model.embed_tokens.weight" in applied.changed and len(applied.changed) > MAX_EVIDENCE_ROWS
    report = nbguard.report()
    [fold] = _folds(view(report.to_document()), "what changed")
    names = [name for name, _ in fold.table.rows]
    assert names[0] == "model.embed_tokens.weight" and set(names) <= set(applied.changed)
    more = len(applied.changed) - MAX_EVIDENCE_ROWS
    assert fold.table.note == f"{more} more not shown; all of them are in the document (to_document())."
    [entry] = [e for e in report.to_document()["entries"] for a in e.get("fixes_applied") or [] if a["changed"]]
    assert entry["fixes_applied"][0]["changed"].keys() == applied.changed.keys()  # where the note says they are
    saved = [report.save(tmp_path / f"r.{ext}").read_text(encoding="utf-8") for ext in ("html", "md")]
    for text in [str(report), *saved]:
        assert "embed tokens" not in text and "JSON report" not in text
    assert "model.embed_tokens.weight" in str(report) and "model.embed_tokens.weight" in saved[0]


def test_the_text_view_of_a_watch_prints_each_fix_cell_once():
    """An event's card and the card of the verification on its step offer the same verified cells: printed once."""
    from verify_helpers import fp16_overflow_run

    _, _, watch = fp16_overflow_run()
    verdicts = watch.verification.verdicts
    assert len(verdicts) >= 3 and all(v.code.strip() for v in verdicts)
    text = str(watch)
    for verdict in verdicts:
        # a line of the cell that only it has: the cell, indented, appears exactly once
        marker = next(line for line in verdict.code.splitlines()
                      if line.strip() and sum(line in v.code for v in verdicts) == 1)
        assert text.count(marker) == 1, (verdict.fix, marker)
        assert f"fix {verdict.fix}: {verdict.title} [{verdict.verdict}]  (its cell is printed above)" in text
    assert "[verified: the failing step is healthy" in text  # the first mention keeps its verdict's reason
    assert len(text) < 12_000
