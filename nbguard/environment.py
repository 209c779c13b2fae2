"""Versions of the libraries that shape numerical behaviour, read without importing them."""
from __future__ import annotations

import platform
import sys
from functools import cache
from importlib import metadata
from typing import Any

from packaging.version import InvalidVersion, Version

from .hardware import detect

TRACKED_PACKAGES = (
    "torch", "transformers", "peft", "accelerate", "trl", "bitsandbytes", "unsloth",
    "ipython", "ipywidgets", "ipykernel", "jupyterlab", "notebook", "numpy", "matplotlib",
)


@cache
def package_version(name: str) -> str | None:
    """The installed version of ``name``, or None when it is not installed."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def parsed_version(name: str) -> Version | None:
    raw = package_version(name)
    if raw is None:
        return None
    try:
        return Version(raw)
    except InvalidVersion:
        return None


def environment_info() -> dict:
    """What a maintainer asks for first in a bug report; plain data, safe to serialise."""
    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "packages": {name: package_version(name) for name in TRACKED_PACKAGES if package_version(name)},
    }
    try:
        import torch

        info["torch_cuda"] = torch.version.cuda
        info["hardware"] = detect().to_dict()
    except Exception as exc:  # torch broken or missing: still report the rest
        info["hardware_error"] = repr(exc)
    return info


def in_release_series(version: Version | None, first: str, stop: str) -> bool:
    """Whether ``version`` belongs to the releases from ``first`` up to (not including) ``stop``.

    Pre-releases and dev builds count as the release they lead to: a bug tied to 4.50.x is in
    4.50.0.dev0 (a source install) and 4.50.0rc1 too, which a plain SpecifierSet(">=4.50.0") excludes.
    """
    if version is None:
        return False
    return Version(first).release <= version.release < Version(stop).release
