"""Execute the notebooks in notebooks/ headless (the machinery of notebooks/run.py) and check their outputs.

Cells tagged "before-fix" must show the failure (a finding or a watch event in their
application/vnd.nbguard.v1+json output); cells tagged "after-fix" must show it gone.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.notebooks

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
                pytest.fail(f"{name} failed:\n{_error_text(nb)}")
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


def _no_errors(nb) -> None:
    assert "(no error output)" == _error_text(nb)


def test_quickstart(execute):
    nb, out = execute("00_quickstart.ipynb")
    _no_errors(nb)
    assert "fp16-overflow-risk" in _rules(_docs(nb, "before-fix", "audit"))
    events = _events(_docs(nb, "before-fix", "watch"))
    assert [e["kind"] for e in events][:1] == ["nonfinite-loss"]
    assert events[0]["cause"] == "overflow"
    assert "model.layers.1.mlp" in _origins(events)
    assert "fp16-overflow-risk" not in _rules(_docs(nb, "after-fix", "audit"))
    assert _events(_docs(nb, "after-fix", "watch")) == []
    assert (out / "00_quickstart.html").is_file()
    report = (out / "00_quickstart.html").read_text()
    assert "model.layers.1.mlp" in report and "switch-precision" in report


def test_gemma3_fp16_t4(execute):
    nb, out = execute("01_gemma3_fp16_t4.ipynb")
    assert "fp16-overflow-risk" in _rules(_docs(nb, "before-fix", "audit"), ("error",))
    events = _events(_docs(nb, "before-fix", "watch"))
    assert events and events[0]["kind"] == "nonfinite-loss" and events[0]["cause"] == "overflow"
    assert _origins(events)[0] == "model.layers.1.mlp"
    compiled = _events(_docs(nb, "before-fix", "compiled"))
    assert _origins(compiled)[0] == "_orig_mod.model.layers.1.mlp"
    assert "CompiledFunctionBackward" in "".join(
        o.get("text", "") for c in nb.cells for o in c.get("outputs", []) if "detect_anomaly" in c.source)
    assert _rules(_docs(nb, "after-fix", "audit"), ("error",)) == set()
    assert _events(_docs(nb, "after-fix", "watch")) == []
    assert (out / "01_gemma3_fp16_t4.html").is_file()
