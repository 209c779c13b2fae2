"""Whether a person's front end is connected to the cell that runs now, and what to do when none is.

A headless run (``jupyter nbconvert --execute``, papermill, ``notebooks/run.py``: all nbclient)
sends its execute requests with ``allow_stdin`` false, since nobody is there to answer ``input()``;
JupyterLab, Notebook 7, VS Code, Colab and the consoles send it true. Headless, a widget is never
seen (the saved copy shows an empty box wherever widget JavaScript cannot load) and
``set_next_input`` is dropped: nbguard shows its static views and prints the cell it would insert.
"""
from __future__ import annotations

from typing import Any

from ..document.outward import say


def front_end_connected(shell: Any = None) -> bool:
    """False only when the running cell's request says no one can answer it (nbclient); True otherwise,
    including a terminal IPython (no kernel: ``set_next_input`` fills the next prompt there)."""
    if shell is None:
        from IPython import get_ipython

        shell = get_ipython()
    kernel = getattr(shell, "kernel", None)
    if kernel is None:
        return True
    try:
        request = kernel.get_parent("shell") or {}
    except Exception:  # an ipykernel without get_parent(channel): assume someone is there
        return True
    content = request.get("content") if isinstance(request, dict) else None
    if not isinstance(content, dict) or "allow_stdin" not in content:
        return True  # not an execute request (a comm message, a thread): nothing says headless
    return bool(content["allow_stdin"])


NOT_INSERTED = ("nbguard: no front end is connected (the notebook runs headless, e.g. nbconvert --execute), "
                "so this cell was not inserted below; its code, to paste into a new cell:")


def put_next_cell(code: str, shell: Any = None) -> bool:
    """Offer ``code`` as the next cell; headless, print it under a line saying it was not inserted.

    True when a front end can take the cell (``set_next_input``), False when it was printed instead.
    """
    if shell is None:
        from IPython import get_ipython

        shell = get_ipython()
    if shell is not None and front_end_connected(shell):
        shell.set_next_input(code, replace=False)
        return True
    say(NOT_INSERTED)
    say(code.rstrip("\n"))
    return False
