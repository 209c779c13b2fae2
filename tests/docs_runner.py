"""Runs the Python blocks of one Markdown page, in order, in one fresh IPython shell (as a reader pastes them
into one notebook): ``python tests/docs_runner.py PAGE.md`` in an empty working directory.

The blocks use names a reader already has (``model``, ``optimizer``, ``trainer``, ...): the shell starts with
the ones a page's blocks name and do not define, built from nbguard.testing's tiny real models (``HARNESS``).
A line that is only ``...  # your loop ...`` is a training loop's body: it runs one real step on ``batch``
(the harness loader's third batch has every label -100, so its loss is NaN and the watch has an event).
A block with magics (a line starting with ``%``) is several notebook cells, split at blank lines.
After each block every watch still attached is detached, as the next example starts on its own.
Prints ``BLOCK <line> ok`` per block; exits 1 at the first block that fails, with its error.

``python tests/docs_runner.py --serve MODULE...`` imports the modules once, then runs each page a request on stdin
names in a process forked from it (a fresh shell and namespace; only the imports are shared): a fresh Python's
imports were most of a page's time. ``page_imports`` names what the page's run imports anyway, so a page sees no
module loaded that it would not have loaded itself.
"""
from __future__ import annotations

import ast
import json
import os
import re
import sys
import tempfile
from pathlib import Path

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))
sys.path.insert(0, str(TESTS.parent))

FENCE = re.compile(r"^(\s*)(`{3,})python\s*$")
EXCERPT = re.compile(r"^\s*<!--\s*excerpt\b:?\s*(.*?)\s*-->\s*$")
PLACEHOLDER = re.compile(r"^(\s*)\.\.\.\s*#\s*your loop")
STEP = """loss = model(**batch).loss
scaler.scale(loss).backward()
scaler.step(optimizer)
scaler.update()
optimizer.zero_grad()"""


def python_blocks(text: str) -> list[tuple[int, str, str | None]]:
    """(line of the fence, code, excerpt reason or None) for every ```python block of a Markdown text."""
    lines, blocks, i = text.splitlines(), [], 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        indent, fence, start = match.group(1), match.group(2), i
        body = []
        i += 1
        while i < len(lines) and lines[i].strip() != fence:
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
            i += 1
        before = next((line for line in reversed(lines[:start]) if line.strip()), "")
        excerpt = EXCERPT.match(before)
        blocks.append((start + 1, "\n".join(body) + "\n", excerpt.group(1) if excerpt else None))
        i += 1
    return blocks


def _tiny_trainer(model, **args):
    from transformers import Trainer, TrainingArguments

    from nbguard.testing import TinyDataset

    settings = dict(output_dir="out", use_cpu=True, report_to=[], save_strategy="no", per_device_train_batch_size=4,
                    max_steps=2, logging_steps=1, learning_rate=1e-4, disable_tqdm=True)
    return Trainer(model=model, args=TrainingArguments(**{**settings, **args}), train_dataset=TinyDataset(8, 16))


def _loader():
    from nbguard.testing import tiny_batch

    batches = [tiny_batch(4, 16, seed=i) for i in range(4)]
    batches[2]["labels"][:] = -100  # nothing to learn: a 0/0 loss, NaN
    return batches


def _grpo_trainer():
    from rl_helpers import grpo_trainer, log_match_reward  # a reward that returns -inf: finite-rewards has work

    return grpo_trainer(Path(tempfile.mkdtemp()), reward_funcs=log_match_reward, max_steps=2)


NEEDS_MODEL = ("model", "optimizer", "opt", "trainer", "loader", "batch", "scaler", "tokenizer")


def _harness(ns: dict, names: set[str], page: str) -> None:
    import torch

    from nbguard.testing import tiny_batch, tiny_llama, word_tokenizer

    def need(*wanted):
        return any(name in names and name not in ns for name in wanted)

    if need(*NEEDS_MODEL):
        ns["model"] = tiny_llama()
    if need("optimizer", "opt"):
        ns["optimizer"] = ns["opt"] = torch.optim.AdamW(ns["model"].parameters(), lr=1e-3)
    if need("scaler"):
        ns["scaler"] = torch.amp.GradScaler("cpu", enabled=False)  # a real GradScaler whose calls pass through
    if need("loader"):
        ns["loader"] = _loader()
    if need("batch"):
        ns["batch"] = tiny_batch(4, 16)
    if need("tokenizer"):
        ns["tokenizer"] = word_tokenizer()
    if need("training_args"):
        from transformers import TrainingArguments

        ns["training_args"] = TrainingArguments(output_dir="out", use_cpu=True, report_to=[], fp16=False)
    if need("trainer"):
        # TRL's guide fixes its GRPO trainer's reward functions: a real GRPOTrainer there, a Trainer elsewhere
        ns["trainer"] = _grpo_trainer() if page.endswith("trl.md") else _tiny_trainer(ns["model"])
    if need("SummaryWriter"):
        from torch.utils.tensorboard import SummaryWriter

        ns["SummaryWriter"] = SummaryWriter
    if need("Accelerator"):
        from accelerate import Accelerator

        ns["Accelerator"] = Accelerator
    for module in ("trackio", "mlflow"):
        if need(module):
            ns[module] = __import__(module)


def _free_names(code: str) -> set[str]:
    try:
        tree = ast.parse(re.sub(r"^\s*[%!].*$", "", code, flags=re.M))
    except SyntaxError:
        return set(re.findall(r"\b[A-Za-z_]\w*\b", code))  # magics' arguments name objects too
    loaded = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)}
    stored = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load)}
    stored |= {(alias.asname or alias.name).split(".")[0] for node in ast.walk(tree)
               if isinstance(node, (ast.Import, ast.ImportFrom)) for alias in node.names}
    return (loaded - stored) | set(re.findall(r"\b[A-Za-z_]\w*\b", "\n".join(re.findall(r"^\s*%.*$", code, flags=re.M))))


def cells(code: str) -> list[str]:
    code = "\n".join(
        "\n".join(match.group(1) + row for row in STEP.splitlines()) if (match := PLACEHOLDER.match(line)) else line
        for line in code.splitlines())
    if not re.search(r"^%", code, flags=re.M):
        return [code]
    return [chunk for chunk in re.split(r"\n\s*\n", code) if chunk.strip()]


def _blocks(page: str) -> list[tuple[int, str]]:
    return [(line, code) for line, code, excerpt in python_blocks(Path(page).read_text()) if excerpt is None]


def _page_names(blocks: list[tuple[int, str]]) -> set[str]:
    return set().union(*(_free_names("\n\n".join(cells(code))) for _, code in blocks)) if blocks else set()


def page_imports(page: str) -> tuple[str, ...]:
    """Modules a run of the page imports whatever its blocks do: the runner's own, and those of the tiny
    objects ``_harness`` builds for it (a tiny Llama, a Trainer), as ``_harness`` decides."""
    names = _page_names(_blocks(page))
    modules = ["torch", "IPython.core.interactiveshell", "nbguard.testing", "nbguard.watcher.core.watch"]
    if names & set(NEEDS_MODEL):
        modules.append("transformers.models.llama.modeling_llama")
    if "trainer" in names and not page.endswith("trl.md"):  # (TRL's guide gets a GRPOTrainer: TRL imports it)
        modules.append("transformers.trainer")  # (it imports transformers.training_args)
    elif "training_args" in names:
        modules.append("transformers.training_args")
    return tuple(modules)


def main(page: str) -> int:
    from IPython.core.interactiveshell import InteractiveShell

    from nbguard.watcher.core.watch import attached_watches

    blocks = _blocks(page)
    shell = InteractiveShell.instance()
    names = _page_names(blocks)
    _harness(shell.user_ns, names, page)
    for line, code in blocks:
        for cell in cells(code):
            result = shell.run_cell(cell, store_history=False)
            error = result.error_before_exec or result.error_in_exec
            if error is not None:
                print(f"BLOCK {line} failed: {type(error).__name__}: {error}\n--- cell ---\n{cell}", flush=True)
                return 1
        for watch in attached_watches():
            watch.detach()
        print(f"BLOCK {line} ok", flush=True)
    return 0


def serve(modules: list[str]) -> int:
    """Import ``modules``, then per request line (JSON: page, cwd, env, stdout and stderr files) fork a process
    that runs the page as ``python docs_runner.py PAGE`` would; answer its pid, then its exit code, a line each."""
    import importlib

    for module in modules:
        importlib.import_module(module)
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _run_forked(**request)
        print(pid, flush=True)
        print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
    return 0


def _run_forked(page: str, cwd: str, env: dict[str, str], stdout: str, stderr: str):
    """In the forked process: the page's directory, environment, argv and output files, then the page; the
    exit (SystemExit) unwinds to the interpreter's own, atexit handlers and all, as a fresh Python's would."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [__file__, page]
    for fd, path in ((1, stdout), (2, stderr)):
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(opened, fd)
        os.close(opened)
    sys.exit(main(page))


if __name__ == "__main__":
    sys.exit(serve(sys.argv[2:]) if sys.argv[1] == "--serve" else main(sys.argv[1]))
