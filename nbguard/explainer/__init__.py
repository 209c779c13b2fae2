"""The exception explainer: known error signatures -> a diagnosis with fixes.

``explain(exc)`` walks the exception chain (``__cause__`` / ``__context__``) and returns the first
:class:`Diagnosis` a registered rule gives, or None. The notebook front end calls it from an
IPython custom exception handler; it works just as well on an exception caught in a script.
"""
from __future__ import annotations

from collections.abc import Iterator

from ..session import record_diagnosis
from .diagnosis import Diagnosis, exception_text
from .rules import RULES, rule


def exception_chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` then the exceptions it was raised from or while handling, each once."""
    seen = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        yield link
        link = link.__cause__ or (None if link.__suppress_context__ else link.__context__)


def diagnose(exc: BaseException) -> Diagnosis | None:
    """Like :func:`explain` without recording the diagnosis in the session."""
    if not isinstance(exc, BaseException):
        raise TypeError(f"explain() needs an exception instance, got {type(exc).__name__}")
    for link in exception_chain(exc):
        for signature_rule in RULES.values():
            diagnosis = signature_rule(link)
            if diagnosis is not None:
                return diagnosis
    return None


def explain(exc: BaseException) -> Diagnosis | None:
    """The diagnosis of a known error signature in ``exc`` (or its chain), recorded for the report."""
    diagnosis = diagnose(exc)
    if diagnosis is not None:
        record_diagnosis(diagnosis)
    return diagnosis


__all__ = ["Diagnosis", "RULES", "diagnose", "exception_chain", "exception_text", "explain", "rule"]
