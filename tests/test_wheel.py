"""The path Colab and every non-checkout user takes: the wheel (`make wheel`), installed into a fresh
venv on a machine with no node on PATH, loads its magics and audits in a real kernel, and JupyterLab
lists its prebuilt extension as enabled.

The venv gets only what the check needs (torch==2.13.0 first, the CPU build; the wheel with its own
dependencies; ipykernel and nbclient to run a kernel; jupyterlab for `jupyter labextension list`),
from pip's cache where it holds them.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# isolated: building the wheel rebuilds nbguard/labextension in place, which the browser tests serve
pytestmark = [pytest.mark.slow, pytest.mark.isolated]

REPO = Path(__file__).resolve().parent.parent
TORCH = "torch==2.13.0"

# Runs inside the fresh venv: a notebook executed by nbclient in a real kernel of that venv.
KERNEL_CHECK = textwrap.dedent("""
    import json, sys
    import nbclient, nbformat
    cells = [
        "%load_ext nbguard",
        "import torch\\nmodel = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).half()",
        "%precision_check model --hardware t4",
        "import nbguard; print(nbguard.__file__)",
    ]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nbclient.NotebookClient(nb, timeout=240, kernel_name="python3").execute()
    audit = [o["data"]["application/vnd.nbguard.v1+json"] for o in nb.cells[2].outputs
             if "application/vnd.nbguard.v1+json" in o.get("data", {})]
    json.dump({"audit": audit, "file": nb.cells[3].outputs[0]["text"].strip()}, sys.stdout)
""")


def _run(args, env, cwd, timeout=600) -> str:
    result = subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{' '.join(map(str, args))} failed:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    return result.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """`pip wheel . --no-deps` (what `make wheel` runs): builds the Lab extension with this machine's node."""
    if shutil.which("npm") is None and not (REPO / "nbguard" / "labextension" / "package.json").is_file():
        pytest.skip("building the wheel needs node and npm (or a prebuilt nbguard/labextension)")
    out = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "-q", "-w", str(out)], dict(os.environ), REPO)
    (built,) = out.glob("nbguard-*.whl")
    return built


def test_wheel_installs_without_node_and_works_in_a_kernel_and_in_jupyterlab(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    bin_dir = venv / "bin"
    # PATH is the venv alone: no node, no npm, no other Python's jupyter
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV", "JUPYTER_PATH")}
    env.update(PATH=str(bin_dir), VIRTUAL_ENV=str(venv), OMP_NUM_THREADS="1", JUPYTER_PLATFORM_DIRS="1")
    assert shutil.which("node", path=env["PATH"]) is None and shutil.which("npm", path=env["PATH"]) is None
    pip = [str(bin_dir / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    _run([*pip, TORCH], env, tmp_path)  # the CPU build first, or the wheel's torch>=2.1 pulls a CUDA one
    _run([*pip, str(wheel), "ipykernel", "nbclient", "nbformat", "jupyterlab>=4.6,<5"], env, tmp_path)

    # a real kernel of the venv (cwd outside the checkout: the installed nbguard is the one imported)
    _run([str(bin_dir / "python"), "-m", "ipykernel", "install", "--sys-prefix", "--name", "python3"], env, tmp_path)
    import json

    result = json.loads(_run([str(bin_dir / "python"), "-c", KERNEL_CHECK], env, tmp_path))
    assert result["file"].startswith(str(venv)), f"the kernel imported {result['file']}, not the installed wheel"
    (audit,) = result["audit"]
    rules = {finding["rule"] for finding in audit["findings"]}
    assert "trainable-low-precision" in rules, rules

    listing = _run([str(bin_dir / "jupyter"), "labextension", "list"], env, tmp_path)
    # jupyter writes the list to stderr on some versions: read both
    listing += subprocess.run([str(bin_dir / "jupyter"), "labextension", "list"], env=env, cwd=tmp_path,
                              capture_output=True, text=True).stderr
    line = next((row for row in listing.splitlines() if row.strip().startswith("nbguard")), "")
    assert "enabled" in line and "OK" in line, listing
    assert (venv / "share" / "jupyter" / "labextensions" / "nbguard" / "package.json").is_file()
