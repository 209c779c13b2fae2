"""Runs the Python blocks of one Markdown page, in order, in one fresh IPython shell (as a reader pastes them
into one notebook): ``python tests/docs_runner.py PAGE.md`` in an empty working directory.

The blocks use names a reader already has (``model``, ``optimizer``, ``trainer``, ...): the shell starts with
the ones a page's blocks name and do not define, built from nbguard.testing's tiny real models (``HARNESS``).
A line that is only ``...  # your loop ...`` is a training loop's body: it runs one real step on ``batch``
(the harness loader's third batch has every label -100, so its loss is NaN and the watch has an event).
A block with magics (a line starting with ``%``) is several notebook cells, split at blank lines.
After each block every watch still attached is detached, as the next example starts on its own.
Prints ``BLOCK <line> ok`` per block; exits 1 at the first block that fails, with its error.
"""
from __future__ import annotations

import ast
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


def _harness(ns: dict, names: set[str], page: str) -> None:
    import torch

    from nbguard.testing import tiny_batch, tiny_llama, word_tokenizer

    def need(*wanted):
        return any(name in names and name not in ns for name in wanted)

    if need("model", "optimizer", "opt", "trainer", "loader", "batch", "scaler", "tokenizer"):
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


def main(page: str) -> int:
    from IPython.core.interactiveshell import InteractiveShell

    from nbguard.watcher.core.watch import attached_watches

    blocks = [(line, code) for line, code, excerpt in python_blocks(Path(page).read_text()) if excerpt is None]
    shell = InteractiveShell.instance()
    names = set().union(*(_free_names("\n\n".join(cells(code))) for _, code in blocks)) if blocks else set()
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


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
