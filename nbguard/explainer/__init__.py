"""The exception explainer: known error signatures -> a diagnosis with fixes.

``explain(exc)`` walks the exception chain (``__cause__`` / ``__context__``) and returns the first
:class:`Diagnosis` a registered rule gives, or None. The notebook front end calls it from
IPython's ``post_run_cell`` event; it works just as well on an exception caught in a script.
Known warnings that announce a failure have their own signatures (:mod:`.warnings`,
``diagnose_warning(text, origin)``).
"""
from __future__ import annotations

from collections.abc import Iterator

from ..session import SESSION, record_diagnosis
from . import (
    compile_rules,  # noqa: F401  (registers the torch.compile signatures)
    liger_rules,  # noqa: F401  (registers the Triton/Liger signatures)
    trl_rules,  # noqa: F401  (registers the TRL signatures)
)
from .diagnosis import Diagnosis, exception_text
from .rules import RULES, rule
from .warnings import WARNING_SIGNATURES, diagnose_warning, warning_signature


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
                return _without_applied_fixes(diagnosis)
    return None


def _without_applied_fixes(diagnosis: Diagnosis) -> Diagnosis:
    """Never propose a fix this session already applied (with changes): the error came after it,
    so applying it again would loop. The diagnosis says so instead."""
    applied = [f["fix"] for f in SESSION.fixes_applied if f.get("changed")]
    again = [fix for fix in diagnosis.fixes if fix in applied]
    if not again:
        return diagnosis
    diagnosis.fixes = [fix for fix in diagnosis.fixes if fix not in again]
    for fix in again:
        diagnosis.fix_options.pop(fix, None)
    diagnosis.evidence["fixes_already_applied"] = again
    diagnosis.detail += (f" {', '.join(again)} was already applied in this session and this error came after it, "
                         "so it is not proposed again: look at what it changed (nbguard.report()) and at the "
                         "objects it did not reach (a model loaded again, a trainer built before it).")
    return diagnosis


def explain(exc: BaseException) -> Diagnosis | None:
    """The diagnosis of a known error signature in ``exc`` (or its chain), recorded for the report."""
    diagnosis = diagnose(exc)
    if diagnosis is not None:
        record_diagnosis(diagnosis)
    return diagnosis


__all__ = ["Diagnosis", "RULES", "WARNING_SIGNATURES", "diagnose", "diagnose_warning", "exception_chain",
           "exception_text", "explain", "rule", "warning_signature"]
