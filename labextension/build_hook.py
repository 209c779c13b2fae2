"""Build the JupyterLab extension while pip builds nbguard (hatch-jupyter-builder's build function).

pyproject.toml names this function in ``[tool.hatch.build.hooks.jupyter-builder]``; hatchling
calls it for wheels, editable installs and sdists. It uses only the machine's Node and npm:

- ``npm ci`` installs exactly what ``labextension/package-lock.json`` pins, and only when
  ``node_modules`` is missing or older than the lockfile;
- ``npm run build:prod`` compiles the TypeScript and bundles the prebuilt extension into
  ``nbguard/labextension``, and only when that output is missing or older than the sources,
  so repeated editable installs (one per test lane) cost nothing.

Set ``SKIP_JUPYTER_BUILDER=1`` to skip the hook entirely (then the wheel has no extension).
"""
from __future__ import annotations

import logging
import shutil
import subprocess
from pathlib import Path

log = logging.getLogger(__name__)

# What the bundle is made from: any of these newer than the output means rebuild.
SOURCES = ("src", "style", "scripts", "package.json", "package-lock.json", "tsconfig.json")


def build(target_name: str, version: str, path: str = "labextension", build_cmd: str = "build:prod",
          output: str = "nbguard/labextension") -> None:
    root = Path(path).resolve()
    out = Path(output).resolve()
    if not _stale(root, out):
        log.info("nbguard labextension: %s is up to date, not rebuilding", out)
        return
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError(
            "Building nbguard from source builds its JupyterLab extension, which needs Node.js (>= 18) "
            "and npm on PATH. Install them, install a prebuilt nbguard wheel instead, or set "
            "SKIP_JUPYTER_BUILDER=1 to build without the extension."
        )
    installed = root / "node_modules" / ".package-lock.json"  # npm writes this after every install
    if not installed.exists() or _mtime(installed) < _mtime(root / "package-lock.json"):
        _run([npm, "ci", "--no-audit", "--no-fund"], root)
    _run([npm, "run", build_cmd], root)
    if not (out / "package.json").exists():
        raise RuntimeError(f"npm run {build_cmd} finished but {out / 'package.json'} is missing")


def _stale(root: Path, out: Path) -> bool:
    built = out / "package.json"
    if not built.exists():
        return True
    newest_source = max(_newest(root / name) for name in SOURCES)
    return newest_source > _mtime(built)


def _newest(path: Path) -> float:
    if not path.exists():
        return 0.0
    if path.is_file():
        return _mtime(path)
    return max((_mtime(p) for p in path.rglob("*") if p.is_file()), default=0.0)


def _mtime(path: Path) -> float:
    return path.stat().st_mtime


def _run(cmd: list[str], cwd: Path) -> None:
    log.info("nbguard labextension: %s (in %s)", " ".join(cmd), cwd)
    subprocess.run(cmd, cwd=cwd, check=True)
