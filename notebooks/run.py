"""Execute nbguard's notebooks headless and keep the executed copies and their reports.

    python notebooks/run.py --out build/demo notebooks/00_quickstart.ipynb
    python notebooks/run.py --out build/notebooks notebooks/*.ipynb

Each notebook runs in a fresh kernel of *this* interpreter (a kernelspec written to a temporary
folder, so a global "python3" kernelspec pointing at another Python is never used), with widget
state stored in the executed copy. The notebooks read ``NBGUARD_OUT`` and save their reports
there. The exit status is non-zero when any notebook fails.

Run this way no one is at a front end: nbguard shows its static views (no widgets), and a fix cell
it would insert is printed in its cell's output instead; this script names those cells.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
KERNEL_NAME = "nbguard-run-python"
CELL_TIMEOUT_S = 300


def _write_kernelspec(folder: Path) -> Path:
    """A kernelspec for sys.executable in ``folder``/kernels (the folder a KernelSpecManager reads)."""
    spec_dir = folder / "kernels" / KERNEL_NAME
    spec_dir.mkdir(parents=True, exist_ok=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": f"Python ({sys.executable})",
        "language": "python",
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    return folder / "kernels"


def _kernel_env(out_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["NBGUARD_OUT"] = str(out_dir.resolve())
    # The checkout's nbguard wins over any installed copy, so CI tests what it checked out.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    return env


def execute_notebook(path: str | os.PathLike, out_dir: str | os.PathLike, *, timeout: int = CELL_TIMEOUT_S):
    """Run one notebook; write the executed copy to ``out_dir``; return (notebook, seconds, error).

    ``error`` is None on success, else the exception raised by a failing cell (the executed copy,
    with the failing cell's traceback in its outputs, is written either way).
    """
    import nbformat
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient

    path = Path(path)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    nb = nbformat.read(path, as_version=4)
    error: BaseException | None = None
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="nbguard-kernel-") as tmp:
        ksm = KernelSpecManager(kernel_dirs=[str(_write_kernelspec(Path(tmp)))], ensure_native_kernel=False)
        # ipc: local sockets in the temporary folder, no TCP port opened (and no warning about one)
        km = KernelManager(kernel_name=KERNEL_NAME, kernel_spec_manager=ksm, transport="ipc", ip=str(Path(tmp) / "kernel-ipc"))
        client = NotebookClient(
            nb,
            km=km,
            timeout=timeout,
            kernel_name=KERNEL_NAME,
            store_widget_state=True,
            resources={"metadata": {"path": str(path.parent.resolve())}},
        )
        env = _kernel_env(out_dir)
        try:
            with client.setup_kernel(env=env, cwd=str(path.parent.resolve())):
                client.execute(reset_kc=False)
        except Exception as exc:  # a failing cell: keep its traceback in the executed copy
            error = exc
        finally:
            # nbclient only shuts down kernels it created itself; this one is ours.
            if km.has_kernel:
                km.shutdown_kernel(now=False)
    seconds = time.perf_counter() - start
    # Keep the committed kernelspec name in the executed copy, not the temporary one.
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, out_dir / path.name)
    return nb, seconds, error


def not_inserted_cells(nb) -> list[int]:
    """The code cells (numbered from 1) whose output says nbguard printed a cell it could not insert."""
    from nbguard.notebook.frontend import NOT_INSERTED

    return [number for number, cell in enumerate(nb.cells, 1) if cell.cell_type == "code" and any(
        NOT_INSERTED in output.get("text", "") for output in cell.get("outputs", []) if output.get("output_type") == "stream")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="+", help="the .ipynb files to execute")
    parser.add_argument("--out", default="build/notebooks", help="folder for executed copies and reports")
    parser.add_argument("--timeout", type=int, default=CELL_TIMEOUT_S, help="seconds allowed per cell")
    options = parser.parse_args(argv)
    out_dir = Path(options.out)
    started = time.time()
    failures = 0
    for name in options.notebooks:
        nb_path = Path(name)
        if not nb_path.is_file():
            print(f"FAIL {name}: no such notebook", file=sys.stderr)
            failures += 1
            continue
        nb, seconds, error = execute_notebook(nb_path, out_dir, timeout=options.timeout)
        status = "ok  " if error is None else "FAIL"
        print(f"{status} {nb_path.name} ({seconds:.1f} s) -> {out_dir / nb_path.name}")
        for number in not_inserted_cells(nb):
            print(f"     cell {number}: a fix cell was not inserted (no front end runs here); "
                  "its code is printed in that cell's output")
        if error is not None:
            failures += 1
            print(f"     {type(error).__name__}: {str(error).strip().splitlines()[-1] if str(error).strip() else ''}",
                  file=sys.stderr)
    # The reports the notebooks of this run wrote (an output folder may hold older ones).
    reports = sorted(p for p in out_dir.glob("*") if p.suffix in {".html", ".md", ".json"}
                     and p.stat().st_mtime >= started) if out_dir.exists() else []
    print(f"executed copies in {out_dir.resolve()}")
    for report in reports:
        print(f"report: {report.resolve()}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
