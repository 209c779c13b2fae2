"""Executing the notebooks in notebooks/ headless (the machinery of notebooks/run.py) and reading their outputs,
for the tests/test_notebooks*.py files. They are several files so that --dist loadfile can give the notebooks
(a fresh kernel each, ~20-60 s apiece) to both workers: in one file they ran on one worker, the Colab lane's
long pole.

Cells tagged "before-fix" must show the failure (a finding or a watch event in their
application/vnd.nbguard.v1+json output); cells tagged "after-fix" must show it gone.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = REPO / "notebooks"
MIME = "application/vnd.nbguard.v1+json"


def _runner():
    spec = importlib.util.spec_from_file_location("nbguard_notebook_runner", NOTEBOOKS / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def execute(tmp_path_factory):
    """Run a notebook once per module; the executed notebook and its output folder."""
    runner = _runner()
    cache: dict[str, tuple] = {}

    def run(name: str):
        if name not in cache:
            out = tmp_path_factory.mktemp(Path(name).stem)
            nb, _seconds, error = runner.execute_notebook(NOTEBOOKS / name, out)
            if error is not None:
                # The exception too: a kernel that died or timed out leaves no error output in any cell.
                pytest.fail(f"{name} failed: {type(error).__name__}: {error}\n{_error_text(nb)}")
            cache[name] = (nb, out)
        return cache[name]

    return run


def _error_text(nb) -> str:
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            if output.get("output_type") == "error":
                return f"{output['ename']}: {output['evalue']}\n--- in cell:\n{cell.source}"
    return "(no error output)"


def _cells(nb, *tags: str) -> list:
    found = [c for c in nb.cells if c.cell_type == "code" and set(tags) <= set(c.metadata.get("tags", []))]
    assert found, f"no code cell tagged {tags}"
    return found


def _docs(nb, *tags: str) -> list[dict]:
    docs = []
    for cell in _cells(nb, *tags):
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            if MIME in data:
                docs.append(data[MIME])
    assert docs, f"cells tagged {tags} have no {MIME} output"
    return docs


def _text(nb, *tags: str) -> str:
    parts = []
    for cell in _cells(nb, *tags):
        for output in cell.get("outputs", []):
            if output.get("output_type") == "stream":
                parts.append(output["text"])
            elif "text/plain" in output.get("data", {}):
                parts.append(output["data"]["text/plain"])
    return "\n".join(parts)


def _rules(docs, severities=("error", "warning")) -> set[str]:
    return {f["rule"] for d in docs for f in d.get("findings", []) if f["severity"] in severities}


def _events(docs) -> list[dict]:
    return [e for d in docs for e in d.get("events", [])]


def _origins(events, phase: str = "forward") -> list[str]:
    return [o["module"] for e in events for o in e.get("origins", []) if o.get("phase") == phase]


def _not_in_tf450_lane() -> None:
    from nbguard.environment import parsed_version

    version = parsed_version("transformers")
    if version is not None and (version.major, version.minor) == (4, 50):
        pytest.skip("runs on current transformers; the 4.50 lane runs only 05_gemma3_hybridcache_tf450")


def _no_errors(nb) -> None:
    assert "(no error output)" == _error_text(nb)


def _number_after(text: str, label: str) -> float:
    return float(text.split(label)[1].split()[0])
