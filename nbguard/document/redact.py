"""Remove secrets from a document before anything is written or shown.

Redaction goes by *value*, never by a name that merely contains "token" or "key": fix cells
(``tokenizer.padding_side = "right"``), module names (``model.embed_tokens``) and config keys
(``pad_token_id``) pass through byte-identical. What is removed, wherever it appears (exception
texts, paths, arguments, evidence, code):

- values of environment variables with a secret-like name: a ``_``-separated part that is TOKEN,
  KEY, SECRET, PASSWORD, PASSWD, PAT, APIKEY or CREDENTIALS (``HF_TOKEN``, ``WANDB_API_KEY``,
  ``GH_PAT``, ``DB_PASSWORD``), and ``DATABASE_URL`` / ``*_DSN``;
- token-shaped strings: Hugging Face ``hf_…``, GitHub ``ghp_``/``gho_``/``ghu_``/``ghs_``/``ghr_``/
  ``github_pat_…``, OpenAI/Anthropic ``sk-…``, Slack ``xox…``, AWS ``AKIA…``/``ASIA…``, JWTs, W&B keys
  (40 hex digits), the credential after ``Bearer`` or an ``Authorization:`` header, the user and
  password in a URL (``postgres://admin:S3cret@db`` becomes ``postgres://[REDACTED]@db``);
- string values of keys that name a secret (``{'password': '…'}``, ``os.environ["HF_TOKEN"] = "…"``,
  ``api_key="…"``, ``--password …``);
- any user's home directory (``/home/x``, ``/Users/x``, ``C:\\Users\\x`` become ``~``);
- whatever the user adds: :func:`redact_also` in the session, or the environment variable
  ``NBGUARD_REDACT`` (literal values separated by commas), read whenever something is redacted.
"""
from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

REDACTED = "[REDACTED]"
USER_SECRETS_ENV = "NBGUARD_REDACT"

# Parts of an environment variable's name that make its value a secret. "PWD" is left out on
# purpose: $PWD is the working directory.
SECRET_ENV_PARTS = frozenset({"TOKEN", "KEY", "SECRET", "PASSWORD", "PASSWD", "PAT", "APIKEY", "CREDENTIALS",
                              "CREDENTIAL", "DSN"})
SECRET_ENV_NAMES = frozenset({"DATABASE_URL"})
MIN_SECRET_LENGTH = 6  # shorter values ("1", "true") would erase ordinary text everywhere

_B = r"(?<![A-Za-z0-9_-])"  # a token starts a word: "task-…" is not an "sk-…" key
TOKEN_SHAPES = [
    re.compile(_B + r"hf_[A-Za-z0-9]{20,}"),
    re.compile(_B + r"(?:gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,})"),
    re.compile(_B + r"sk-(?:[A-Za-z0-9]+-)*[A-Za-z0-9_]{20,}"),
    re.compile(_B + r"xox[abposr]-[A-Za-z0-9-]{10,}"),
    re.compile(_B + r"(?:AKIA|ASIA)[0-9A-Z]{16}(?![0-9A-Z])"),
    re.compile(_B + r"eyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]+"),  # JWT
    re.compile(r"(?<![0-9A-Za-z])[0-9a-f]{40}(?![0-9A-Za-z])"),  # W&B API keys: 40 hex digits
]
# "Authorization: token ghp_…", "authorization='Basic dXNlcjpwYXNz'": keep the scheme, hide the rest.
AUTHORIZATION = re.compile(r"(?i)(authorization['\"]?\s*[:=]\s*['\"]?(?:(?:bearer|token|basic|bot)\s+)?)"
                           r"([^\s'\",;}]+)")
BEARER = re.compile(r"(?i)(\bbearer\s+)([A-Za-z0-9._~+/-]{8,}=*)")
URL_CREDENTIALS = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)[^\s/@'\"<>]+@")

# A key that names a secret (compared whole, case-insensitively): "password", "db_password",
# "client_secret", "api_key", "hf_token", "access_token"; never "pad_token" or "embed_tokens".
SECRET_KEY = re.compile(r"(?i)(?:\w*[_-])?(?:password|passwd|secret|api[_-]?key|apikey|private[_-]?key|"
                        r"secret[_-]?key|credentials?)|(?:hf|hub|api|access|auth|bearer|refresh|id|session|"
                        r"github|gh|slack|wandb)?[_-]?token")
# 'name': 'value', "name" = "value", ['NAME'] = 'value'  (a quoted key and a quoted value)
QUOTED_KEY = re.compile(r"""(['"])([\w.-]+)\1(\s*\]?\s*[:=]\s*)(['"])((?:(?!\4).)+)\4""")
# name="value", name: value, --name value  (a bare name; the whole name must name a secret)
BARE_ASSIGNMENT = re.compile(r"""(?<![\w.'"-])([A-Za-z_][\w]*)(\s*[=:]\s*)(['"]?)([^\s'",;&)}\]]+)""")
FLAG = re.compile(r"""(?<![\w-])--([\w-]+)(\s+|=)(['"]?)([^\s'",;&-][^\s'",;&]*)""")

HOME_DIRS = re.compile(r"(?<![\w.-])(?:/home/|/Users/|[A-Za-z]:(?:\\\\|\\|/)Users(?:\\\\|\\|/))"
                       r"(?!Public\b|Shared\b)[^/\\\s'\"<>:]+")

_USER_VALUES: set[str] = set()
_USER_PATTERNS: list[re.Pattern] = []


def redact_also(*items: str | re.Pattern) -> None:
    """Redact these too, from now on in this session: literal strings (at least
    ``MIN_SECRET_LENGTH`` characters) or compiled regular expressions."""
    for item in items:
        if isinstance(item, re.Pattern):
            _USER_PATTERNS.append(item)
        elif isinstance(item, str) and len(item.strip()) >= MIN_SECRET_LENGTH:
            _USER_VALUES.add(item)
        else:
            raise ValueError(f"redact_also takes strings of at least {MIN_SECRET_LENGTH} characters or compiled "
                             f"regular expressions, got {item!r}")


def is_secret_env_name(name: str) -> bool:
    upper = name.upper()
    return upper in SECRET_ENV_NAMES or any(part in SECRET_ENV_PARTS for part in upper.split("_"))


def is_secret_key(name: str) -> bool:
    return SECRET_KEY.fullmatch(name) is not None


def _with_hidden_group(match: re.Match, group: int) -> str:
    """The match's text with group ``group`` replaced by REDACTED (unless it already is)."""
    whole, value = match.group(0), match.group(group)
    if value.startswith("[REDACTED"):
        return whole
    start, end = match.start(group) - match.start(), match.end(group) - match.start()
    return whole[:start] + REDACTED + whole[end:]


def _hide(pattern: re.Pattern, text: str, value_group: int) -> str:
    return pattern.sub(lambda m: _with_hidden_group(m, value_group), text)


def _plain_word(match: re.Match, value_group: int) -> bool:
    """An unquoted lower-case word after a secret-like name is prose ("the BOS token: stop the
    tokenizer…", "--token none"), not a secret: secrets have digits, capitals or symbols."""
    value = match.group(value_group)
    quoted = match.re is not QUOTED_KEY and bool(match.group(value_group - 1))
    return not quoted and value.isalpha() and value.islower()


def _hide_named(pattern: re.Pattern, text: str, name_group: int, value_group: int) -> str:
    """Hide the value of each match whose name (its last dotted part) names a secret."""
    def sub(match: re.Match) -> str:
        if not is_secret_key(match.group(name_group).rsplit(".", 1)[-1]):
            return match.group(0)
        if _plain_word(match, value_group):
            return match.group(0)
        return _with_hidden_group(match, value_group)
    return pattern.sub(sub, text)


class Redactor:
    """Redacts strings and nested JSON data; built once from an environment and a home dir."""

    def __init__(self, env: Mapping[str, str] | None = None, *, home: bool | str = True):
        env = os.environ if env is None else env
        secrets = [(value, f"[REDACTED:{name}]") for name, value in env.items()
                   if is_secret_env_name(name) and isinstance(value, str)]
        user_values = list(_USER_VALUES) + [v for v in str(env.get(USER_SECRETS_ENV, "")).split(",")]
        secrets += [(value, REDACTED) for value in user_values]
        self.values = sorted(((v, label) for v, label in secrets if len(v.strip()) >= MIN_SECRET_LENGTH),
                             key=lambda item: -len(item[0]))  # longest first: a value inside another
        self.patterns = list(_USER_PATTERNS)
        home_dir = str(Path.home()) if home is True else (home or "")
        home_dir = home_dir.rstrip("/\\")
        self.home = re.compile(re.escape(home_dir) + r"(?![\w.-])") if len(home_dir) > 1 and home else None
        self.any_home = bool(home)

    def text(self, value: str) -> str:
        for secret, label in self.values:
            if secret in value:
                value = value.replace(secret, label)
        for pattern in self.patterns:
            value = pattern.sub(REDACTED, value)
        value = URL_CREDENTIALS.sub(r"\1" + REDACTED + "@", value)
        for shape in TOKEN_SHAPES:
            value = shape.sub(REDACTED, value)
        value = _hide(AUTHORIZATION, value, 2)
        value = _hide(BEARER, value, 2)
        value = _hide_named(QUOTED_KEY, value, 2, 5)
        value = _hide_named(BARE_ASSIGNMENT, value, 1, 4)
        value = _hide_named(FLAG, value, 1, 4)
        if self.home is not None:
            value = self.home.sub("~", value)
        if self.any_home:
            value = HOME_DIRS.sub("~", value)
        return value

    def data(self, value: Any) -> Any:
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, dict):
            out = {}
            for key, item in value.items():
                key = self.text(key) if isinstance(key, str) else key
                if isinstance(key, str) and is_secret_key(key) and isinstance(item, str) and item:
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

    ``env`` defaults to ``os.environ``; ``home=True`` replaces this user's and every other user's
    home directory with "~", a string names this user's home instead (another root such as
    ``/work/alice``), ``False`` keeps paths as they are.
    """
    return Redactor(env, home=home).data(value)
