"""``WatchConfig``: the watch's settings, one section per registered component.

``nbguard.watch(model, optimizer=opt, config=WatchConfig(stall={"after_s": 600}))``: each keyword is a
component's name (:mod:`.registry`), its value that component's settings dataclass or a dict of its
fields. A section not given takes the component's defaults. The ``watch()`` keywords a component took
before (``stall_after_s=``) still work for one release, with a DeprecationWarning naming the section.
"""
from __future__ import annotations

import ast
import dataclasses
from typing import Any

from ...document.outward import outward_text, warn
from .registry import registered_components


class WatchConfig:
    """Per-component settings for a watch; ``WatchConfig(section=..., ...)``."""

    def __init__(self, **sections: Any):
        components = registered_components()
        self._sections: dict[str, Any] = {}
        for name, value in sections.items():
            spec = components.get(name)
            if spec is None or spec.settings is None:
                known = sorted(n for n, s in components.items() if s.settings is not None)
                raise TypeError(f"WatchConfig has no section {name!r}; its sections are the watch's components: "
                                f"{', '.join(known)}")
            self._sections[name] = _section(name, spec.settings, value)
        for name, spec in components.items():
            if spec.settings is not None and name not in self._sections:
                self._sections[name] = spec.settings()

    @classmethod
    def from_assignments(cls, assignments: list[str]) -> WatchConfig:
        """``["stall.after_s=600", "run_checks.enabled=False"]`` (the magics' ``--config``): each value a
        Python literal (``None``, ``False``, ``1e-3``, ``'text'``), or else the text itself."""
        sections: dict[str, dict[str, Any]] = {}
        for assignment in assignments:
            key, equals, text = assignment.partition("=")
            name, dot, field = key.strip().partition(".")
            if not equals or not dot or not name or not field:
                raise ValueError(f"--config takes SECTION.FIELD=VALUE (e.g. stall.after_s=600), got {assignment!r}")
            sections.setdefault(name, {})[field.strip()] = _literal(text.strip())
        return cls(**sections)

    def section(self, name: str) -> Any:
        """The settings of component ``name`` (its defaults where none were given)."""
        return self._sections.get(name)

    def sections(self) -> dict[str, Any]:
        return dict(self._sections)

    def replace(self, name: str, **changes: Any) -> WatchConfig:
        """A copy with some fields of one section changed."""
        copy = WatchConfig.__new__(WatchConfig)
        copy._sections = dict(self._sections)
        copy._sections[name] = _section(name, type(self._sections[name]),
                                        {**dataclasses.asdict(self._sections[name]), **changes})
        return copy

    def __eq__(self, other: object) -> bool:
        return isinstance(other, WatchConfig) and other._sections == self._sections

    def __repr__(self) -> str:
        return outward_text(f"WatchConfig({', '.join(f'{k}={v!r}' for k, v in sorted(self._sections.items()))})")


def _literal(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text  # a bare word: the text itself (a section's own check says if it is wrong)


def describe_sections() -> list[str]:
    """One line per registered section: its fields with their defaults, then what the component does."""
    lines = []
    for name, spec in sorted(registered_components().items()):
        if spec.settings is None:
            continue
        fields = ", ".join(f"{f.name}={f.default!r}" for f in dataclasses.fields(spec.settings))
        lines.append(f"{name}: {fields}" + (f" ({spec.summary})" if spec.summary else ""))
    return lines


def _section(name: str, settings: type, value: Any) -> Any:
    if isinstance(value, settings):
        return value
    if not isinstance(value, dict):
        raise TypeError(f"WatchConfig({name}=...) takes a {settings.__name__} or a dict of its fields, "
                        f"got {type(value).__name__}")
    fields = {f.name for f in dataclasses.fields(settings)}
    unknown = sorted(set(value) - fields)
    if unknown:
        raise TypeError(f"WatchConfig({name}=...) has no field {', '.join(map(repr, unknown))}; "
                        f"{settings.__name__}'s fields: {', '.join(sorted(fields))}")
    return settings(**value)


def config_from_keywords(config: WatchConfig | None, keywords: dict[str, Any]) -> WatchConfig:
    """``config`` with the deprecated ``watch()`` keywords a component still answers to folded in
    (each with a DeprecationWarning that names the section); an unknown keyword is a TypeError."""
    if config is not None and not isinstance(config, WatchConfig):
        raise TypeError(f"config must be a nbguard.WatchConfig, got {type(config).__name__}")
    config = config if config is not None else WatchConfig()
    by_alias = {alias: (name, field) for name, spec in registered_components().items()
                for alias, field in spec.aliases.items()}
    for keyword, value in keywords.items():
        if keyword not in by_alias:
            raise TypeError(f"watch() got an unexpected keyword argument {keyword!r}")
        name, field = by_alias[keyword]
        warn(f"watch({keyword}=...) is deprecated: pass config=nbguard.WatchConfig({name}={{{field!r}: ...}})",
                      DeprecationWarning, stacklevel=4)  # the user's nbguard.watch(...) call
        config = config.replace(name, **{field: value})
    return config
