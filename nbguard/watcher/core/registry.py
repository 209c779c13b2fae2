"""The watch's components, each registered by the module that owns it, with the settings it takes.

A component module in :mod:`nbguard.watcher.components` calls :func:`register_component` at import: its
name (the ``WatchConfig`` section), how to make it for a watch, the dataclass of its settings, and the
``watch()`` keywords it took before ``config=`` existed (kept one release as deprecated aliases). The watch
core never names a component: it makes every registered one (:func:`make_components`), and the magics
list the same settings (``config.describe_sections``). Adding a component is adding
its module.
"""
from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .pipeline import WatchComponent


@dataclass(frozen=True)
class ComponentSetup:
    """What a component's factory is given: its settings section and the watch's choices."""

    settings: Any  # the component's settings dataclass instance (None if it declares none)
    policy: str
    trainer: Any = None  # the watched Trainer, else None
    thresholds: Any = None  # the watch's detectors.WatchSettings
    reads: Any = None  # the watch's sentinel.GradNormCollector (its parameters by group, on the device)
    history: Any = None  # the watch's history.GradHistory


@dataclass(frozen=True)
class ComponentSpec:
    name: str
    make: Callable[[ComponentSetup], WatchComponent | None]  # None: not wanted for this watch
    settings: type | None = None  # a dataclass; its fields are the WatchConfig section's keys
    aliases: dict[str, str] = field(default_factory=dict)  # old watch() keyword -> settings field
    summary: str = ""  # one line for the magics' help and the docs
    last: bool = False  # judges after every other component (and the user's detectors): the run checks


_COMPONENTS: dict[str, ComponentSpec] = {}


def register_component(name: str, make: Callable[[ComponentSetup], WatchComponent | None], *,
                       settings: type | None = None, aliases: dict[str, str] | None = None,
                       summary: str = "", last: bool = False) -> ComponentSpec:
    """Register a watch component (see docs/guides/detectors.md, "Components"); returns its spec."""
    if not name or not name.replace("_", "").isalnum() or not name[0].isalpha():
        raise ValueError(f"a component's name is its WatchConfig section, a Python identifier; got {name!r}")
    if settings is not None and not dataclasses.is_dataclass(settings):
        raise TypeError(f"settings of component {name!r} must be a dataclass, got {settings!r}")
    fields = {f.name for f in dataclasses.fields(settings)} if settings is not None else set()
    for keyword, target in (aliases or {}).items():
        if target not in fields:
            raise ValueError(f"alias {keyword!r} of component {name!r} names {target!r}, not a field of its settings")
    existing = _COMPONENTS.get(name)
    spec = ComponentSpec(name, make, settings, dict(aliases or {}), summary, last)
    if existing is not None and existing.make.__module__ != make.__module__:  # (a module reloaded replaces its own)
        raise ValueError(f"a component named {name!r} is already registered (by {existing.make.__module__})")
    _COMPONENTS[name] = spec
    return spec


def registered_components() -> dict[str, ComponentSpec]:
    """Every registered component by name, the built-in ones loaded first."""
    load_builtin()
    return dict(_COMPONENTS)


def load_builtin() -> None:
    """Import :mod:`nbguard.watcher.components` (it imports each of its modules, which register themselves)."""
    importlib.import_module("nbguard.watcher.components")


def make_components(sections: dict[str, Any], **setup: Any) -> tuple[list[WatchComponent], list[WatchComponent]]:
    """One of each registered component this watch wants, in name order (stable): (those that judge
    first, those registered ``last``); ``setup``: the rest of :class:`ComponentSetup`."""
    first: list[WatchComponent] = []
    last: list[WatchComponent] = []
    for name, spec in sorted(registered_components().items()):
        component = spec.make(ComponentSetup(sections.get(name), **setup))
        if component is not None:
            (last if spec.last else first).append(component)
    return first, last
