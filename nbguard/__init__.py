"""nbguard: keep fine-tuning runs in notebooks numerically healthy.

The core works in a plain Python script::

    import nbguard
    result = nbguard.audit(model, args=training_args, hardware="t4")
    with nbguard.watch(model, optimizer=opt) as watch:
        ...  # your training loop
    nbguard.report(audit=result, watch=watch).save("nbguard-report.html")

In a notebook, ``%load_ext nbguard`` adds ``%precision_check`` and ``%nanwatch``.
"""
from __future__ import annotations

__version__ = "0.1.0"

from .errors import NbguardError, NonFiniteError
from .findings import Event, Finding, Origin, Severity
from .hardware import Hardware, resolve_hardware


def audit(model=None, trainer=None, *, args=None, batch=None, hardware=None, probe=False, verify=False):
    """Audit a fine-tuning setup's precision against the hardware; returns an ``AuditResult``.

    ``verify=True`` runs every fix the findings offer on a shadow of one training step on ``batch``
    (the probe's synthetic batch when none is given): ``result.verification``.
    """
    from .auditor import run_audit

    return run_audit(model=model, trainer=trainer, args=args, batch=batch, hardware=hardware, probe=probe,
                     verify=verify)


def watch(target, *, optimizer=None, scaler=None, policy="warn", localize=True, activations=False, verify=True):
    """Attach a NaN/Inf watch to a model (with its optimizer) or a Trainer; returns a ``NanWatch``.

    ``activations=True`` also records each module group's output abs-max per step (fp16 headroom).
    ``verify=True`` runs the fixes of the first localised NaN/Inf on a shadow of its step (at most
    about 3 step times); ``verify=False`` turns that off.
    """
    from .watcher import NanWatch

    return NanWatch(target, optimizer=optimizer, scaler=scaler, policy=policy, localize=localize,
                    activations=activations, verify=verify).attach()


def verify(subject, fix_id=None, **kwargs):
    """Run the candidate fixes of a watch event (or audit finding) on the failing step; returns a ``Verification``.

    ``nbguard.verify(watch.events[0])``; ``nbguard.verify(finding, model=model, batch=batch)``;
    ``fix_id="init-new-embeddings"`` checks one fix; ``memory_budget=`` (bytes) caps the step level.
    """
    from .verifier import verify as _verify

    return _verify(subject, fix_id, **kwargs)


def explain(exc):
    """A ``Diagnosis`` for a known error signature in ``exc``, or None."""
    from .explainer import explain as _explain

    return _explain(exc)


def report(audit=None, watch=None):
    """A ``Report``; with no arguments, everything this session recorded."""
    from .reporting import build_report

    return build_report(audit=audit, watch=watch)


def load_ipython_extension(ipython):
    from .notebook.extension import load

    load(ipython)


def unload_ipython_extension(ipython):
    from .notebook.extension import unload

    unload(ipython)


_LAZY_SUBMODULES = ("fixes", "testing")


def __getattr__(name):
    # `nbguard.fixes.apply(...)` after a plain `import nbguard`, without paying for torch at import.
    if name in _LAZY_SUBMODULES:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _jupyter_labextension_paths():
    return [{"src": "labextension", "dest": "nbguard"}]


__all__ = [
    "Event", "Finding", "Hardware", "NbguardError", "NonFiniteError", "Origin", "Severity",
    "audit", "explain", "fixes", "report", "resolve_hardware", "verify", "watch", "__version__",
]
