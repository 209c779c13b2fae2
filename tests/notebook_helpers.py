"""Helpers for the front-end tests: a real InteractiveShell with nbguard loaded, and output capture."""
from __future__ import annotations

import copy
import re

import pytest
from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output

MIME = "application/vnd.nbguard.v1+json"
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"


class Cell:
    def __init__(self, result, cap):
        self.result, self.cap = result, cap
        ansi = re.compile(r"\x1b\[[0-9;]*m")  # tracebacks are coloured
        self.stdout, self.stderr = ansi.sub("", cap.stdout), ansi.sub("", cap.stderr)
        self.outputs = [o.data for o in cap.outputs if not o.update]  # new outputs of this cell
        self.updates = [o.data for o in cap.outputs if o.update]  # in-place updates of earlier outputs

    @property
    def docs(self):
        return [o[MIME] for o in self.outputs if MIME in o]

    @property
    def updated_docs(self):
        return [o[MIME] for o in self.updates if MIME in o]

    @property
    def error(self):
        return self.result.error_in_exec or self.result.error_before_exec


def run(ip, code: str) -> Cell:
    with capture_output() as cap:
        result = ip.run_cell(code)
    return Cell(result, cap)


@pytest.fixture
def shell():
    """The process' InteractiveShell with nbguard loaded; unloaded and namespace cleaned afterwards."""
    ip = InteractiveShell.instance()
    before = set(ip.user_ns)
    # `%config NbguardMagics.x = ...` lives in the shell's config, which outlives the extension (as in
    # IPython): a test that turned verify_fixes off left every later test on its worker unverified
    magics_config = copy.deepcopy(ip.config.get("NbguardMagics"))
    run(ip, "%load_ext nbguard")
    yield ip
    run(ip, "%unload_ext nbguard")
    if magics_config is None:
        ip.config.pop("NbguardMagics", None)
    else:
        ip.config["NbguardMagics"] = magics_config
    for name in set(ip.user_ns) - before:
        del ip.user_ns[name]


def assert_fallbacks(outputs) -> None:
    """Every nbguard output carries text/plain and a static text/html beside its data."""
    assert outputs, "no output was displayed"
    for data in outputs:
        assert {"text/plain", "text/html", MIME} <= set(data), sorted(data)
        assert data["text/plain"].strip() and "<" in data["text/html"]


def usage_line(cell: Cell) -> str:
    """The one line a magic's bad input printed: the cell failed with IPython's UsageError, no traceback."""
    from IPython.core.error import UsageError

    assert type(cell.error) is UsageError, (cell.error, cell.stderr)
    lines = cell.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("UsageError: nbguard: "), cell.stderr
    assert "Traceback" not in cell.stdout + cell.stderr
    return lines[0][len("UsageError: "):]
