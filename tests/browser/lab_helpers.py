"""Start a real JupyterLab that loads nbguard's built extension, for the browser tests.

The server serves only the extension under test (``--LabApp.labextensions_path`` points at a
temporary copy of ``nbguard/labextension``, the folder the wheel ships), so the test checks exactly
what ``pip install`` builds, and no unrelated extension can add console noise.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbguard

REPO_ROOT = Path(__file__).resolve().parents[2]
BUILT_EXTENSION = Path(nbguard.__file__).resolve().parent / "labextension"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-background-networking", "--disable-component-update"]
ARTIFACTS = REPO_ROOT / "test-artifacts" / "browser"


def require_built_extension() -> Path:
    """The built extension folder; a clear failure when the build hook has not run."""
    if not (BUILT_EXTENSION / "package.json").exists():
        raise AssertionError(
            f"the lab extension is not built ({BUILT_EXTENSION} is missing): run `pip install -e .` "
            "(its build hook runs npm ci + npm run build:prod) or, in labextension/, "
            "`npm ci && npm run build:prod`"
        )
    return BUILT_EXTENSION


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LabServer:
    """``jupyter lab`` on 127.0.0.1 with a temporary root and isolated Jupyter dirs."""

    def __init__(self, workdir: Path, app: str = "jupyterlab"):
        self.app = app  # "jupyterlab", or "notebook" for Notebook 7 (same extension system)
        self.workdir = workdir
        self.root = workdir / "root"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = ARTIFACTS / f"{app}-server.log"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 120.0) -> LabServer:
        built = require_built_extension()
        self.root.mkdir(parents=True, exist_ok=True)
        extensions = self.workdir / "labextensions"
        shutil.copytree(built, extensions / "nbguard")  # served by package name, as when installed
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        env["OMP_NUM_THREADS"] = "1"
        for name in ("JUPYTER_CONFIG_DIR", "JUPYTER_DATA_DIR", "JUPYTER_RUNTIME_DIR", "IPYTHONDIR"):
            path = self.workdir / name.lower()
            path.mkdir(exist_ok=True)
            env[name] = str(path)
        # No "get Jupyter news?" toast over the screenshots (user settings live in the temp config dir).
        notification = Path(env["JUPYTER_CONFIG_DIR"]) / "lab" / "user-settings" / "@jupyterlab" / "apputils-extension"
        notification.mkdir(parents=True)
        (notification / "notification.jupyterlab-settings").write_text(json.dumps({"fetchNews": "false"}))
        # Only the extension under test: a config file, since a list trait is awkward on the CLI.
        paths = {"labextensions_path": [str(extensions)], "extra_labextensions_path": []}
        (Path(env["JUPYTER_CONFIG_DIR"]) / "jupyter_lab_config.json").write_text(json.dumps({"LabApp": paths}))
        # The language-server endpoint both front ends poll (jupyter-lsp comes with jupyterlab).
        server = {"ServerApp": {"jpserver_extensions": {"jupyter_lsp": True}}}
        (Path(env["JUPYTER_CONFIG_DIR"]) / "jupyter_server_config.json").write_text(json.dumps(server))
        (Path(env["JUPYTER_CONFIG_DIR"]) / "jupyter_notebook_config.json").write_text(
            json.dumps({"JupyterNotebookApp": paths})
        )
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable, "-m", self.app,
            "--no-browser", "--ip=127.0.0.1", f"--port={self.port}",
            "--IdentityProvider.token=", "--ServerApp.password=", "--allow-root",
            f"--ServerApp.root_dir={self.root}",
            # window.jupyterapp: lets the test read cell sources and outputs exactly from the model
            f"--{self.app_class}.expose_app_in_browser=True",
        ]
        if self.app == "jupyterlab":
            cmd.append("--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate")
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT, cwd=self.workdir)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"jupyter lab exited with {self.proc.returncode}; see {self.log_path}")
            try:
                with urllib.request.urlopen(f"{self.url}/api/status", timeout=2) as response:
                    if response.status == 200:
                        return self
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise AssertionError(f"jupyter lab did not answer on {self.url} within {timeout:.0f} s; see {self.log_path}")

    @property
    def app_class(self) -> str:
        return "LabApp" if self.app == "jupyterlab" else "JupyterNotebookApp"

    def api(self, path: str):
        """GET a server REST endpoint (no token is configured)."""
        with urllib.request.urlopen(f"{self.url}{path}", timeout=10) as response:
            body = response.read()
        return json.loads(body) if body else None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if getattr(self, "_log", None):
            self._log.close()


def write_notebook(path: Path, cells: list[tuple[str, str]], kernel: str = "python3") -> None:
    """A minimal nbformat 4 notebook: ``cells`` is [(cell_type, source)]."""
    nb_cells = []
    for i, (cell_type, source) in enumerate(cells):
        cell = {"cell_type": cell_type, "id": f"cell-{i}", "metadata": {}, "source": source}
        if cell_type == "code":
            cell.update(execution_count=None, outputs=[])
        nb_cells.append(cell)
    nb = {
        "cells": nb_cells,
        "metadata": {
            "kernelspec": {"display_name": "Python 3", "language": "python", "name": kernel},
            "language_info": {"name": "python"},
        },
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    path.write_text(json.dumps(nb, indent=1))


# A notebook whose %precision_check output carries a live widget next to nbguard's document:
# what the widget browser tests open, run, restart and reload.
WIDGETS_LABEXTENSION = Path(sys.prefix) / "share" / "jupyter" / "labextensions" / "@jupyter-widgets"
WIDGET_NOTEBOOK_CELLS = [
    "%load_ext nbguard",
    "import torch\nfrom nbguard.testing import tiny_llama\nmodel = tiny_llama(dtype=torch.float16)",
    "%precision_check --hardware t4",
    "print('a later cell')",
]
# From the notebook model: cell sources, execution counts, the kernel's status and whether it is dirty.
JS_NOTEBOOK_STATE = """(path) => { const app = window.jupyterapp;
  if (!app || !app.shell) { return null; }  // the page is still booting: the app is exposed once started
  const panel = Array.from(app.shell.widgets('main')).find(w => w.context && w.context.path === path);
  if (!panel || !panel.content.model) { return null; }
  const cells = [];
  for (let i = 0; i < panel.content.model.cells.length; i++) {
    const c = panel.content.model.cells.get(i);
    cells.push({source: c.sharedModel.getSource(), n: c.type === 'code' ? c.executionCount : null});
  }
  const kernel = panel.sessionContext.session && panel.sessionContext.session.kernel;
  return {cells, kernel: kernel ? kernel.status : null, dirty: panel.context.model.dirty}; }"""
