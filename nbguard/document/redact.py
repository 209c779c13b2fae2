"""Remove secrets from a document before anything is written or shown.

A bug report is pasted into public issues, so redaction errs on the side of removing too much:
Hugging Face tokens, W&B API keys, values of environment variables whose names contain TOKEN,
KEY, SECRET or PASSWORD (wherever they appear: exception texts, paths, arguments, evidence),
``name=value`` assignments of tokens, keys and passwords, and optionally the home directory.
"""
from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

REDACTED = "[REDACTED]"

SECRET_ENV_NAME = re.compile(r"TOKEN|KEY|SECRET|PASSWORD", re.IGNORECASE)
MIN_ENV_SECRET_LENGTH = 6  # shorter values ("1", "true") would erase ordinary text everywhere

HF_TOKEN = re.compile(r"hf_[A-Za-z0-9]{20,}")
WANDB_KEY = re.compile(r"(?<![0-9A-Za-z])[0-9a-f]{40}(?![0-9A-Za-z])")  # W&B API keys: 40 hex digits
# "token=...", "api_key: ...", "--password ...". Each word start is tried (zero-width matches,
# so "error: token=..." finds both "error" and "token"); the name is checked in Python, since a
# regex searching inside names backtracks badly on long words.
ASSIGNMENT = re.compile(r"(?<![\w.-])(?=([\w.-]+)(\s*[=:]\s*['\"]?)([^\s'\",;&]+))")
FLAG = re.compile(r"(?<![\w-])(?=(--[\w-]+)(\s+['\"]?)([^\s'\",;&-][^\s'\",;&]*))")
BEARER = re.compile(r"(?i)(?<![\w-])(?=(bearer)(\s+)([^\s'\",;&]+))")
SECRET_NAME_HINT = re.compile(r"(?i)token|api[_-]?key|secret|password|passwd")
SECRET_FLAG_HINT = re.compile(r"(?i)token|key|secret|password")
ANY = re.compile(r"")  # matches every name: whatever follows "Bearer" is a credential


def _hide_assigned(text: str, pattern: re.Pattern, hint: re.Pattern) -> str:
    """Replace the values assigned to secret-looking names in ``text``."""
    spans = []
    for match in pattern.finditer(text):
        name, sep, value = match.groups()
        if hint.search(name) and not value.startswith("[REDACTED"):
            start = match.start() + len(name) + len(sep)
            spans.append((start, start + len(value)))
    if not spans:
        return text
    out, last = [], 0
    for start, end in sorted(spans):
        if start < last:  # nested in a value already hidden
            continue
        out.append(text[last:start] + REDACTED)
        last = end
    return "".join(out) + text[last:]

# dict keys whose (string) value is a secret: "hf_token", "WANDB_API_KEY", "password"
SECRET_KEY = re.compile(r"(?i)(?:^|[_\-.])(?:token|api[_-]?key|secret|password|passwd)$")


class Redactor:
    """Redacts strings and nested JSON data; built once from an environment and a home dir."""

    def __init__(self, env: Mapping[str, str] | None = None, *, home: bool | str = True):
        env = os.environ if env is None else env
        self.env_values = sorted(
            ((value, name) for name, value in env.items()
             if SECRET_ENV_NAME.search(name) and isinstance(value, str) and len(value.strip()) >= MIN_ENV_SECRET_LENGTH),
            key=lambda item: -len(item[0]),
        )
        home_dir = str(Path.home()) if home is True else (home or "")
        home_dir = home_dir.rstrip("/")
        self.home = re.compile(re.escape(home_dir) + r"(?![\w.-])") if len(home_dir) > 1 else None

    def text(self, value: str) -> str:
        for secret, name in self.env_values:
            if secret in value:
                value = value.replace(secret, f"[REDACTED:{name}]")
        value = HF_TOKEN.sub(REDACTED, value)
        value = WANDB_KEY.sub(REDACTED, value)
        value = _hide_assigned(value, ASSIGNMENT, SECRET_NAME_HINT)
        value = _hide_assigned(value, FLAG, SECRET_FLAG_HINT)
        value = _hide_assigned(value, BEARER, ANY)
        if self.home is not None:
            value = self.home.sub("~", value)
        return value

    def data(self, value: Any) -> Any:
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, dict):
            out = {}
            for key, item in value.items():
                key = self.text(key) if isinstance(key, str) else key
                if isinstance(key, str) and SECRET_KEY.search(key) and isinstance(item, str) and item:
                    out[key] = REDACTED
                else:
                    out[key] = self.data(item)
            return out
        if isinstance(value, list):
            if value and not any(isinstance(v, (str, dict, list)) for v in value):
                return list(value)  # a row of numbers: nothing to redact, skip the per-item walk
            return [self.data(v) for v in value]
        if isinstance(value, tuple):
            return [self.data(v) for v in value]
        return value


def redact(value: Any, *, env: Mapping[str, str] | None = None, home: bool | str = True) -> Any:
    """A redacted copy of ``value`` (a string or JSON-like data; the input is not changed).

    ``env`` defaults to ``os.environ``; ``home=True`` replaces this user's home directory with
    "~", a string replaces that path instead, ``False`` keeps paths as they are.
    """
    return Redactor(env, home=home).data(value)
