"""The output boundary: every string nbguard sends out of the process passes :func:`outward`, here.

Out of the process means anywhere a text can be read by someone else or outlive the kernel: a
document or a rendered report, a file nbguard writes, a tracker (TensorBoard, W&B, trackio, MLflow,
accelerate's trackers: their runs are uploaded and shared), an alert, a warning, ``print`` (saved as
a cell's output), a ``display``, the Lab comm, ``repr``/``str`` of a public result object.

:func:`outward` is :func:`nbguard.document.redact.redact` (the redaction algorithm lives there); this
module is the one place the exits call it, so an exit that bypasses it is visible:
``tests/test_redaction_exits.py`` walks nbguard's source, finds every exit and fails on one whose
text does not come from here. :func:`warn` and :func:`say` are ``warnings.warn`` and ``print`` with
their text passed through it.
"""
from __future__ import annotations

import sys
import warnings
from dataclasses import fields, is_dataclass
from typing import Any

from .redact import redact


def outward(value: Any, *, home: bool | str = True) -> Any:
    """``value`` (a string or JSON-like data) as it may leave the process: secrets removed, home
    directories as ``~`` (``home`` as in :func:`~nbguard.document.redact.redact`). Redact a text
    whole, then cut it: half a token has no shape left."""
    return redact(value, home=home)


def outward_text(value: Any) -> str:
    """``str(value)``, redacted."""
    return str(outward(str(value)))


def exception_line(exc: BaseException) -> str:
    """``TypeName: message`` of an exception, redacted: exception messages quote URLs, paths, headers."""
    return outward_text(f"{type(exc).__name__}: {exc}")


def warn(message: Any, category: type[Warning] = UserWarning, stacklevel: int = 1) -> None:
    """``warnings.warn`` of a redacted text (a warning is printed into the cell's output, saved in the notebook)."""
    warnings.warn(outward_text(message), category, stacklevel=stacklevel + 1)


def say(*parts: Any, file: Any = None, sep: str = " ") -> None:
    """``print`` of redacted text (printed output is saved in the notebook)."""
    print(outward_text(sep.join(str(p) for p in parts)), file=file if file is not None else sys.stdout)


def dataclass_repr(obj: Any) -> str:
    """The repr a ``@dataclass`` would give ``obj`` (its ``repr=True`` fields), redacted: for public result
    classes declared with ``repr=False`` so their repr goes through this boundary."""
    if not is_dataclass(obj):
        return outward_text(object.__repr__(obj))
    parts = ", ".join(f"{f.name}={getattr(obj, f.name)!r}" for f in fields(obj) if f.repr)
    return outward_text(f"{type(obj).__qualname__}({parts})")
