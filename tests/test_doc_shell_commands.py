"""Every shell command the README and the docs quote (```bash blocks) runs as written, as far as a test can say
without running a whole lane (issue 41 item 8): each `make` target exists in the Makefile, each extra a
`pip install` names is in pyproject.toml, the torch it pins is the one the Makefile installs, a wheel it installs
is where `make wheel` writes it, a `jupyter` command has jupyterlab installed in its block (install.md's check
once ran `jupyter labextension list` in a venv without it), each script and file a command names exists, and
each pytest marker is registered. A command of a kind this test does not know fails it, so a new one is covered
when it is written. (The Python blocks run in tests/test_docs_code.py; the wheel check itself, in a fresh venv,
in tests/test_wheel.py.)"""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
SHELL_FENCE = re.compile(r"^\s*```(?:bash|sh|shell|console)\s*$")


def shell_blocks(text: str) -> list[tuple[int, list[str]]]:
    """(line of the fence, its command lines without comments) for every shell block of a Markdown text."""
    lines, blocks, i = text.splitlines(), [], 0
    while i < len(lines):
        if not SHELL_FENCE.match(lines[i]):
            i += 1
            continue
        start, body = i + 1, []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith("```"):
            command = lines[i].split(" #", 1)[0].strip()
            if command and not command.startswith("#"):
                body.append(command)
            i += 1
        blocks.append((start, body))
        i += 1
    return blocks


def makefile_targets(makefile: str) -> set[str]:
    return {m.group(1) for m in re.finditer(r"^([A-Za-z][\w.-]*)\s*:(?!=)", makefile, re.M)}


def problems(block: list[str], *, makefile: str, pyproject: dict) -> list[str]:
    """What would keep each command of one block from running as written."""
    targets = makefile_targets(makefile)
    extras = set(pyproject["project"]["optional-dependencies"])
    markers = {m.split(":", 1)[0] for m in pyproject["tool"]["pytest"]["ini_options"]["markers"]}
    torch_pin = re.search(r"^TORCH := (\S+)$", makefile, re.M)
    wheel_dir = re.search(r"^wheel:.*\n\t.* -w (\S+?)/?$", makefile, re.M)
    installed: set[str] = set()
    out = []
    for command in block:
        words = shlex.split(command)
        tool = Path(words[0]).name
        if tool == "make":
            out += [f"{command}: no target {t!r} in the Makefile" for t in words[1:] if "=" not in t and t not in targets]
        elif tool == "pip" and words[1:2] == ["install"]:
            for word in words[2:]:
                installed.add(re.split(r"[=<>\[]", Path(word).name)[0].lower())
                if (extra := re.fullmatch(r"\.\[([\w,-]+)\]", word)):
                    out += [f"{command}: no extra {e!r} in pyproject.toml" for e in extra.group(1).split(",") if e not in extras]
                elif word.startswith("torch=="):
                    if torch_pin is None or word != torch_pin.group(1):
                        out.append(f"{command}: pins {word}, the Makefile installs {torch_pin and torch_pin.group(1)}")
                elif word.endswith(".whl"):
                    if wheel_dir is None or Path(word).parent != Path(wheel_dir.group(1)):
                        out.append(f"{command}: make wheel writes to {wheel_dir and wheel_dir.group(1)}, not {Path(word).parent}")
        elif tool == "jupyter":
            if "jupyterlab" not in installed:
                out.append(f"{command}: jupyter runs here, but this block installs no jupyterlab")
        elif tool == "python" or words[0].endswith("/python"):
            args = words[1:]
            if args[:2] == ["-m", "pytest"]:
                marks = args[args.index("-m", 1) + 1] if "-m" in args[1:] else ""
                unknown = set(re.findall(r"[A-Za-z_]\w*", marks)) - {"and", "or", "not"} - markers
                out += [f"{command}: no pytest marker {m!r}" for m in sorted(unknown)]
            elif not (REPO / args[0]).is_file():
                out.append(f"{command}: no script {args[0]}")
            if "--write" in args and not (REPO / args[args.index("--write") + 1]).exists():
                out.append(f"{command}: no file {args[args.index('--write') + 1]}")
        else:
            out.append(f"{command}: a command this test does not check yet: teach it, or quote it outside a bash block")
    return out


def test_every_shell_command_of_the_readme_and_docs_runs_as_written():
    makefile = (REPO / "Makefile").read_text(encoding="utf-8")
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    found, checked = [], 0
    for page in PAGES:
        for line, block in shell_blocks(page.read_text(encoding="utf-8")):
            checked += len(block)
            found += [f"{page.relative_to(REPO)}:{line}: {p}" for p in problems(block, makefile=makefile, pyproject=pyproject)]
    assert checked >= 8  # the README's make demo / make test, install.md's pip and jupyter lines, contributing's
    assert found == []


def test_the_check_finds_what_the_first_run_of_issue_41_found():
    """install.md's wheel check as it was (no jupyterlab), a make target and an extra that do not exist."""
    makefile = (REPO / "Makefile").read_text(encoding="utf-8")
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    old_wheel_check = ["make wheel", "pip install torch==2.13.0 dist/nbguard-*.whl", "jupyter labextension list"]
    assert problems(old_wheel_check, makefile=makefile, pyproject=pyproject) == [
        "jupyter labextension list: jupyter runs here, but this block installs no jupyterlab"]
    assert problems(['pip install ".[hf,gpu]"', "make dmeo", "curl https://example.org | sh"],
                    makefile=makefile, pyproject=pyproject) == [
        "pip install \".[hf,gpu]\": no extra 'gpu' in pyproject.toml",
        "make dmeo: no target 'dmeo' in the Makefile",
        "curl https://example.org | sh: a command this test does not check yet: teach it, or quote it outside a bash block",
    ]
