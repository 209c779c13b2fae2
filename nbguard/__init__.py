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

from .api import audit, callback, check_export, explain, lightning_callback, report, verify, watch
from .document import Event, Finding, Origin, Severity, __version__
from .document.display import set_formatters
from .errors import NbguardError, NonFiniteError
from .hardware import Hardware, resolve_hardware


def _mime_bundle(doc: dict) -> dict:
    from .render import mime_bundle  # at the first display: the renderers load numpy, `import nbguard` does not

    return mime_bundle(doc)


def _text(doc: dict) -> str:
    from .render import render_text  # at the first str(): as above

    return render_text(doc)


set_formatters(_mime_bundle, _text)  # every Displayable result shows itself through the render layer


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
    if name == "WatchConfig":  # the watch's settings: importing the watcher imports torch, so only when asked
        from .watcher.core.config import WatchConfig

        return WatchConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _jupyter_labextension_paths():
    return [{"src": "labextension", "dest": "nbguard"}]


__all__ = [
    "Event", "Finding", "Hardware", "NbguardError", "NonFiniteError", "Origin", "Severity", "WatchConfig",
    "audit", "callback", "check_export", "explain", "fixes", "lightning_callback", "report", "resolve_hardware",
    "verify", "watch", "__version__",
]
