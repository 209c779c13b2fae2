"""What the guides say is what the code does: every Python block in README.md and docs/**/*.md runs here
(with tiny real objects for the names it uses), the API signatures they quote match the real functions,
the notebooks they list are those in notebooks/, and the install guide's "imported only when you audit or
watch their objects" holds in a fresh interpreter."""
from __future__ import annotations

import importlib
import inspect
import json
import os
import re
import select
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from docs_runner import FENCE, page_imports, python_blocks
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
        assert [event.kind for event in watch.events] == ["nonfinite-loss"], watch.events  # (the NaN input's loss)
        str(watch)
        nbguard.report(audit=audit, watch=watch).to_html()
        print("LOADED", loaded())
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "LOADED []" in result.stdout, result.stdout[-2000:]


def test_a_trainer_is_still_recognised_without_importing_transformers_for_plain_models():
    import transformers
    import transformers.trainer  # noqa: F401  (what defining or importing any Trainer does)

    from nbguard.watcher.core.watch import _is_trainer

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
    from nbguard.watcher.core.watch import attached_watches

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
    from nbguard.render import render_text

    full = render_text(report.to_dict(), full=True)  # print(report) leaves the evidence a call away
    assert "model.embed_tokens.weight" in full and "model.embed_tokens.weight" in saved[0]


def test_the_text_view_of_a_watch_prints_each_fix_cell_once():
    """An event's card and the verification on its step share the same verified cells: the full text prints each
    once; the first screen (``str(watch)``) prints none, only the fixes in one line (issue 41)."""
    from verify_helpers import fp16_overflow_run

    from nbguard.render import render_text

    _, _, watch = fp16_overflow_run()
    verdicts = watch.verification.verdicts
    assert len(verdicts) >= 3 and all(v.code.strip() for v in verdicts)
    text, full = str(watch), render_text(watch.to_document(), full=True)
    for verdict in verdicts:
        # a line of the cell that only it has: the cell, indented, appears exactly once
        marker = next(line for line in verdict.code.splitlines()
                      if line.strip() and sum(line in v.code for v in verdicts) == 1)
        assert full.count(marker) == 1 and marker not in text, (verdict.fix, marker)
        assert f"fix {verdict.fix}: {verdict.title} [{verdict.verdict}" in full
        assert f"{verdict.fix} [{verdict.verdict}]" in text
    assert "[verified: the failing step is healthy" in full  # the cell's mention keeps its verdict's reason
    # the full view is the cells (each once, checked above) and a bounded rest: a plain loop's cells grew with its
    # input cast, the prose around them must not
    assert len(text.splitlines()) <= 40 and len(full) - sum(len(v.code) for v in verdicts) < 8_000


# -- every Python block of the docs runs ----------------------------------------------------------------------

PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
MAX_EXCERPTS = 5  # blocks that cannot run here: a GPU, an account, a hub download, a fragment of a larger set-up


def _name(page: Path) -> str:
    return str(page.relative_to(REPO))


def _runnable(page: Path) -> list[int]:
    return [line for line, _, excerpt in python_blocks(page.read_text(encoding="utf-8")) if excerpt is None]


def _env(cwd: Path | None = None) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled",
           "PYTHONPATH": str(REPO)}
    env.pop("MLFLOW_TRACKING_URI", None)  # MLflow's default store, in cwd
    env.pop("TRACKIO_DIR", None)
    return env if cwd is None else {**env, "TRACKIO_DIR": str(cwd / "trackio")}


class Runners:
    """``docs_runner.py --serve``, one process per set of modules the pages' runs import anyway, started at the
    first page that needs it: each page runs in a process forked from it, so a page pays for its own imports
    only (a fresh Python's imports were most of a page's time)."""

    def __init__(self) -> None:
        self.servers: dict[tuple[str, ...], subprocess.Popen] = {}

    def run(self, page: Path, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
        modules = page_imports(str(page))
        if modules not in self.servers:
            self.servers[modules] = subprocess.Popen(
                [sys.executable, str(REPO / "tests" / "docs_runner.py"), "--serve", *modules], cwd=REPO,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_env())
        server = self.servers[modules]
        out, err = (cwd.parent / f"{cwd.name}.{stream}" for stream in ("stdout", "stderr"))  # not in the page's folder
        server.stdin.write(json.dumps({"page": str(page), "cwd": str(cwd), "env": _env(cwd), "stdout": str(out),
                                       "stderr": str(err)}) + "\n")
        server.stdin.flush()
        pid = server.stdout.readline()
        assert pid, f"the docs runner importing {modules} exited ({server.wait()}): its stderr is in the captured output"
        if not select.select([server.stdout], [], [], timeout)[0]:
            os.kill(int(pid), signal.SIGKILL)
        code = int(server.stdout.readline())
        return subprocess.CompletedProcess([str(page)], code, out.read_text(), err.read_text())

    def close(self) -> None:
        for server in self.servers.values():  # nothing of theirs to keep: no interpreter shutdown to wait for
            server.kill()
            server.wait(timeout=60)
            server.stdin.close()
            server.stdout.close()


@pytest.fixture(scope="module")
def runner():
    runners = Runners()
    yield runners.run
    runners.close()


@pytest.mark.slow
@pytest.mark.parametrize("page", [p for p in PAGES if _runnable(p)], ids=_name)
def test_every_python_block_of_the_page_runs(page, tmp_path, runner):
    """The page's blocks, in order, in one fresh shell with tiny real objects for the names they use."""
    result = runner(page, tmp_path)
    ran = [int(n) for n in re.findall(r"^BLOCK (\d+) ok$", result.stdout, re.M)]
    assert result.returncode == 0 and ran == _runnable(page), (result.stdout[-4000:], result.stderr[-3000:])


def test_the_runner_fails_on_a_broken_block_and_skips_only_marked_excerpts(tmp_path, runner):
    page = tmp_path / "page.md"
    page.write_text("# t\n\n<!-- excerpt: a fragment -->\n```python\nraise SystemExit(3)\n```\n\n"
                    "```python\nx = model.config.vocab_size\n```\n\n```python\nassert x == 0, 'the block is wrong'\n```\n")
    result = runner(page, tmp_path)
    assert result.returncode == 1 and "BLOCK 8 ok" in result.stdout  # the excerpt skipped, model supplied
    assert "BLOCK 12 failed: AssertionError: the block is wrong" in result.stdout


def test_pages_run_by_one_runner_share_no_state(tmp_path, runner):
    """Pages forked from the same runner process: what one page changes, the next does not see; each has its own
    directory, environment and argv, as a fresh Python would."""
    first, second = tmp_path / "first", tmp_path / "second"
    for folder in (first, second):
        folder.mkdir()
    (first / "page.md").write_text("```python\nimport sys, torch\ntorch.left_by_the_first_page = 1\n```\n")
    (second / "page.md").write_text(
        "```python\nimport os, sys, torch\nassert not hasattr(torch, 'left_by_the_first_page')\n"
        "assert os.getcwd() == os.path.dirname(sys.argv[1]) and os.environ['TRACKIO_DIR'].startswith(os.getcwd())\n```\n")
    assert page_imports(str(first / "page.md")) == page_imports(str(second / "page.md"))  # the same runner
    results = [runner(folder / "page.md", folder) for folder in (first, second)]
    assert [r.returncode for r in results] == [0, 0] and all("BLOCK 1 ok" in r.stdout for r in results), results


def test_every_python_fence_is_read_and_excerpts_are_few_and_say_why():
    excerpts = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        blocks = python_blocks(text)
        assert len(blocks) == sum(bool(FENCE.match(line)) for line in text.splitlines()), _name(page)
        excerpts += [(_name(page), line, why) for line, _, why in blocks if why is not None]
        assert "<!-- excerpt" not in re.sub(r"<!--\s*excerpt\b.*-->\n\s*```python", "", text), \
            f"{_name(page)}: an excerpt marker that is not right before a ```python block"
    assert all(why for _, _, why in excerpts), f"an excerpt without its reason: {excerpts}"
    assert 0 < len(excerpts) <= MAX_EXCERPTS, excerpts


# -- the API calls the docs quote name real parameters ----------------------------------------------------------
CALL = re.compile(r"\bnbguard((?:\.[A-Za-z_]\w*)+)\(")
# a public function that forwards **kwargs: its keywords are those of the function it forwards to
FORWARDS = {"nbguard.verify": "nbguard.verifier.verify"}


def _args(text: str, start: int) -> str | None:
    """The text between the parenthesis at ``start`` and its match, or None when the quote is cut."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, "[": 1, "{": 1, ")": -1, "]": -1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + 1:i]
    return None


def _split(args: str) -> list[str]:
    parts, depth, current, quote = [], 0, "", ""
    for ch in args:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(current.strip())
            current = ""
            continue
        current += ch
    return [p for p in [*parts, current.strip()] if p]


def _resolve(dotted: str):
    module_name, _, attr = dotted.rpartition(".")
    return getattr(importlib.import_module(module_name), attr)


def quoted_calls() -> list[tuple[str, str, list[str]]]:
    """(where, nbguard.<name>, its arguments) for every call or signature quoted in README.md and docs/."""
    calls = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for match in CALL.finditer(text):
            args = _args(text, match.end() - 1)
            if args is not None and "\n\n" not in args:
                line = text.count("\n", 0, match.start()) + 1
                calls.append((f"{_name(page)}:{line}", "nbguard" + match.group(1), _split(args)))
    return calls


def wrong_parameters(where: str, name: str, args: list[str]) -> tuple[int, list[str]]:
    """(how many names were checked, what is wrong) for one quoted call or signature of ``name``."""
    target = _resolve(FORWARDS.get(name, name))
    if inspect.isclass(target) or not callable(target):
        return 0, []
    params = inspect.signature(target).parameters
    wrong = []
    if name in FORWARDS and not any(p.kind is p.VAR_KEYWORD for p in inspect.signature(_resolve(name)).parameters.values()):
        wrong.append(f"{name} no longer forwards **kwargs to {FORWARDS[name]}: update FORWARDS")
    # `**deprecated` (nbguard.watch) takes only the old keywords of the watch's components: the docs use config=
    takes_any = any(p.kind is p.VAR_KEYWORD and p.name != "deprecated" for p in params.values())
    signature_quote = any(a == "*" or a.endswith("=") for a in args)  # `f(x, *, model=, batch=)`
    positional = [p.name for p in params.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    checked = 0
    for index, arg in enumerate(args):
        keyword = re.match(r"^([A-Za-z_]\w*)\s*=(?!=)", arg)
        if keyword:
            checked += 1
            if keyword.group(1) not in params and not takes_any:
                wrong.append(f"{where}: {name}() has no parameter {keyword.group(1)!r}")
        elif signature_quote and re.fullmatch(r"[A-Za-z_]\w*", arg):
            checked += 1
            if index >= len(positional) or positional[index] != arg:
                wrong.append(f"{where}: {name}()'s parameter {index + 1} is {positional[index:index + 1]}, not {arg!r}")
    return checked, wrong


def test_quoted_api_calls_name_parameters_the_functions_have():
    results = [wrong_parameters(*call) for call in quoted_calls()]
    assert [w for _, wrong in results for w in wrong] == []
    assert sum(checked for checked, _ in results) >= 20  # the check reads the docs' calls at all


def test_the_signature_check_catches_a_wrong_name():
    assert wrong_parameters("x.md:1", "nbguard.verify", _split("event_or_finding, fix_id=None, *, model=")) == (
        3, ["x.md:1: nbguard.verify()'s parameter 1 is ['subject'], not 'event_or_finding'"])
    assert wrong_parameters("x.md:2", "nbguard.watch", _split("model, optimiser=opt, policy='skip'"))[1] == [
        "x.md:2: nbguard.watch() has no parameter 'optimiser'"]
    assert wrong_parameters("x.md:3", "nbguard.verify", _split("event, memory_budgett=1"))[1] == [
        "x.md:3: nbguard.verify() has no parameter 'memory_budgett'"]


# -- the notebooks the docs list are the notebooks there are ---------------------------------------------------
def test_the_notebooks_guide_lists_every_notebook_and_no_other():
    text = (REPO / "docs" / "guides" / "notebooks.md").read_text(encoding="utf-8")
    section = text.split("## The notebooks", 1)[1]
    listed = set(re.findall(r"`(\d\d_[a-z0-9_]+)`", section))
    assert listed == {path.stem for path in (REPO / "notebooks").glob("*.ipynb")}


def test_every_file_the_docs_point_to_exists():
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for path in re.findall(r"`((?:notebooks|tests|benchmarks|docs|constraints)/[\w./-]+\.(?:ipynb|py|md|txt|sh))`", text):
            assert (REPO / path).exists(), f"{_name(page)} names {path}, which does not exist"

