"""The watch's components that register themselves (:mod:`nbguard.watcher.core.registry`): importing this
package imports each module in it, so a component is added by adding its module here."""
from __future__ import annotations

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
