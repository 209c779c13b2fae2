"""The nbconvert exporter on a really executed notebook: ``jupyter nbconvert --to nbguard``."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("nbconvert")

from report_helpers import HF_TOKEN, HOSTILE, Refs  # noqa: E402

from nbguard.document.merge import gather  # noqa: E402
from nbguard.findings import MIME_TYPE  # noqa: E402
from nbguard.reporting import schema  # noqa: E402
from nbguard.reporting.nbconvert import NbguardExporter, notebook_documents  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
KERNEL_SECRET = "kernel-side-Secret-4711"


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """A notebook that trains a tiny model under nbguard.watch with a planted overflow, shows the
    watch, an audit document carrying planted secrets, and a report; executed by a real kernel."""
    tmp = tmp_path_factory.mktemp("nb")
    cells = [
        f"import sys\nsys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'tests')!r}]\n"
        "import nbguard\nfrom IPython.display import display\n"
        "from report_helpers import audit_document, watched_run_with_planted_fault",
        "model, watch = watched_run_with_planted_fault()\ndisplay(watch)",
        "doc = audit_document()\n"
        f"doc['findings'][0]['detail'] += ' token={HF_TOKEN} and ' + __import__('os').environ['MY_KERNEL_TOKEN']\n"
        f"display({{{MIME_TYPE!r}: doc, 'text/plain': 'audit'}}, raw=True)",
        "print('plain output is ignored')\n1 + 1",
    ]
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in cells]
    env_before = os.environ.get("MY_KERNEL_TOKEN")
    os.environ["MY_KERNEL_TOKEN"] = KERNEL_SECRET  # the kernel inherits it, so does the converter
    try:
        client = nbclient.NotebookClient(nb, timeout=240, kernel_name="python3",
                                         resources={"metadata": {"path": str(tmp)}})
        client.execute()
    finally:
        if env_before is None:
            os.environ.pop("MY_KERNEL_TOKEN")
        else:
            os.environ["MY_KERNEL_TOKEN"] = env_before
    path = tmp / "planted.ipynb"
    nbformat.write(nb, path)
    return nb, path


@pytest.fixture
def kernel_secret_env(monkeypatch):
    monkeypatch.setenv("MY_KERNEL_TOKEN", KERNEL_SECRET)


def test_the_executed_notebook_holds_nbguard_outputs(executed):
    nb, _ = executed
    docs = notebook_documents(nb)
    assert [d["kind"] for d in docs] == ["watch", "audit"]
    watch_doc = docs[0]
    event = next(e for e in watch_doc["events"] if e["kind"].startswith("nonfinite"))
    assert event["step"] == 2 and event["origins"][0]["module"].endswith(HOSTILE)


def test_exporter_api_makes_one_self_contained_html_report(executed, kernel_secret_env):
    nb, _ = executed
    exporter = NbguardExporter()
    assert exporter.export_from_notebook and exporter.file_extension == ".nbguard.html"
    output, resources = exporter.from_notebook_node(nb, resources={"metadata": {"name": "planted"}})
    assert resources["output_extension"] == ".nbguard.html"
    parser = Refs()
    parser.feed(output)
    parser.close()
    for tag, attrs in parser.tags:
        assert tag not in ("script", "link", "iframe")
        assert all(attrs[k].startswith("data:") for k in ("src", "href") if k in attrs)
    assert "nbguard report: planted" in output
    assert "Findings (3)" in output and "nonfinite-loss" in output and "data:image/png;base64," in output
    assert "<script>" not in output and "&lt;script&gt;" in output
    assert HF_TOKEN not in output and KERNEL_SECRET not in output


def test_exporter_markdown_and_json(executed, kernel_secret_env):
    nb, _ = executed
    md, resources = NbguardExporter(report_format="md").from_notebook_node(nb, resources={"metadata": {"name": "planted"}})
    assert resources["output_extension"] == ".nbguard.md"
    assert resources["outputs"]["planted.heatmap.png"].startswith(b"\x89PNG")
    assert "![gradient-norm heatmap](planted.heatmap.png)" in md
    text, _ = NbguardExporter(report_format="json").from_notebook_node(nb, resources={"metadata": {"name": "planted"}})
    data = json.loads(text)
    assert data["kind"] == "report" and len(gather(data, "watches")) == 1 and len(gather(data, "findings")) == 3
    assert HF_TOKEN not in text and KERNEL_SECRET not in text
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.Draft202012Validator(schema()).validate(data)
    with pytest.raises(ValueError, match="report_format"):
        NbguardExporter(report_format="pdf")


def test_exporter_on_a_notebook_without_nbguard_outputs_says_so():
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("1 + 1")]
    output, _ = NbguardExporter().from_notebook_node(nb, resources={"metadata": {"name": "empty"}})
    assert "has no saved nbguard outputs" in output


def _nbconvert(to: str, path: Path, env_extra: dict) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.update(env_extra)
    return subprocess.run([sys.executable, "-m", "jupyter", "nbconvert", "--to", to, str(path)],
                          capture_output=True, text=True, env=env, timeout=120)


def test_jupyter_nbconvert_command_line(executed):
    """The command line with the exporter named by class path: no installed entry point needed."""
    _, path = executed
    proc = _nbconvert("nbguard.reporting.nbconvert.NbguardExporter", path, {"MY_KERNEL_TOKEN": KERNEL_SECRET})
    assert proc.returncode == 0, proc.stderr
    report = path.with_name(f"{path.stem}.nbguard.html")
    html_text = report.read_text(encoding="utf-8")
    assert "nbguard report: planted" in html_text and KERNEL_SECRET not in html_text
    report.unlink()


def test_nbguard_report_and_html_export_are_two_files(executed):
    """``--to html`` then ``--to nbguard`` on one notebook: two files, neither overwrites the other."""
    _, path = executed
    for to in ("html", "nbguard.reporting.nbconvert.NbguardExporter"):
        proc = _nbconvert(to, path, {"MY_KERNEL_TOKEN": KERNEL_SECRET})
        assert proc.returncode == 0, proc.stderr
    page, report = path.with_suffix(".html"), path.with_name(f"{path.stem}.nbguard.html")
    assert "nbguard report: planted" in report.read_text(encoding="utf-8")
    assert "jp-Notebook" in page.read_text(encoding="utf-8")  # nbconvert's page of the notebook, still there
    page.unlink()
    report.unlink()


def _declared_entry_point() -> str:
    import tomllib

    with open(ROOT / "pyproject.toml", "rb") as fh:
        project = tomllib.load(fh)["project"]
    return project["entry-points"]["nbconvert.exporters"]["nbguard"]


def test_pyproject_declares_the_exporter():
    assert _declared_entry_point() == "nbguard.reporting.nbconvert:NbguardExporter"


def test_jupyter_nbconvert_to_nbguard_by_entry_point(executed, tmp_path):
    """``--to nbguard`` through the entry point: the installed one when nbguard is pip-installed,
    otherwise the pyproject declaration published by a throw-away dist-info on PYTHONPATH."""
    from nbconvert.exporters import ExporterNameError, get_exporter

    extra_path = ""
    try:
        assert get_exporter("nbguard") is NbguardExporter
    except ExporterNameError:
        dist = tmp_path / "site" / "nbguard_entry_point-0.0.dist-info"
        dist.mkdir(parents=True)
        (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: nbguard-entry-point\nVersion: 0.0\n")
        (dist / "entry_points.txt").write_text(f"[nbconvert.exporters]\nnbguard = {_declared_entry_point()}\n")
        extra_path = str(tmp_path / "site")
    _, path = executed
    env = {"MY_KERNEL_TOKEN": KERNEL_SECRET}
    if extra_path:
        env["PYTHONPATH"] = os.pathsep.join([extra_path, str(ROOT)])
    listing = subprocess.run(
        [sys.executable, "-c", "from nbconvert.exporters import get_export_names, get_exporter as g; "
                               "print('nbguard' in get_export_names(), g('nbguard').export_from_notebook)"],
        capture_output=True, text=True, env=dict(os.environ, **env), timeout=60)
    assert listing.stdout.split() == ["True", "nbguard", "report"], listing.stderr  # JupyterLab's export menu
    proc = _nbconvert("nbguard", path, env)
    assert proc.returncode == 0, proc.stderr
    html_text = path.with_name(f"{path.stem}.nbguard.html").read_text(encoding="utf-8")
    assert "nbguard report: planted" in html_text and KERNEL_SECRET not in html_text
