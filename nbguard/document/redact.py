"""Remove secrets from a document before anything is written or shown.

The specification is data, below: :data:`SHAPES` (secrets recognised by their own shape, with how
real ones are built), :data:`NAMED_CONTEXTS` (secrets recognised by the key that names them),
:data:`KEPT` (look-alikes that must pass through unchanged, and why). The threat model's list of
what is removed (docs/guides/threat-model.md) is :func:`spec_markdown` of these tables, and the
property tests (tests/test_redact_spec.py) generate their keys from the same samples.

Redaction goes by *value* or by a name that really names a secret, never by a name that merely
contains "token" or "key": fix cells (``tokenizer.padding_side = "right"``), module names
(``model.embed_tokens``), config keys (``pad_token_id``), digests in paths and literals
(``token=True``) pass through byte-identical. Redact a text whole, then cut it: a token cut in
half no longer has its shape.
"""
from __future__ import annotations

import os
import re
import string
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REDACTED = "[REDACTED]"
USER_SECRETS_ENV = "NBGUARD_REDACT"

# Parts of an environment variable's name that make its value a secret. "PWD" is left out on
# purpose: $PWD is the working directory.
SECRET_ENV_PARTS = frozenset({"TOKEN", "KEY", "SECRET", "PASSWORD", "PASSWD", "PAT", "APIKEY", "CREDENTIALS",
                              "CREDENTIAL", "DSN"})
SECRET_ENV_ENDINGS = ("PASSWORD", "PASSWD", "PASSPHRASE")  # libpq's PGPASSWORD has no "_" before it
SECRET_ENV_NAMES = frozenset({"DATABASE_URL", "MYSQL_PWD"})
MIN_SECRET_LENGTH = 6  # shorter values ("1", "true") would erase ordinary text everywhere

# ---------------------------------------------------------------------------------------------
# Where a secret may start. A token starts a word ("task-…" is no "sk-…" key), but an escape
# sequence right before it is a boundary too: the "n" of "\n" in a repr() or json.dumps() of a
# multi-line string, the "D" of "%3D" in a URL-encoded query, the "m" closing a terminal colour.
_AFTER_ESCAPE = r"(?<=\\[ntrfvab0])|(?<=%[0-9A-Fa-f]{2})|(?<=\[\dm)|(?<=\[\d\dm)|(?<=;\dm)|(?<=;\d\dm)"
_START = rf"(?:(?<![A-Za-z0-9_-])|{_AFTER_ESCAPE})"
_SPACE = r"(?:\s+|\+|%20)"  # a space, also URL-encoded
_COLON = r"(?:\s*[:=]\s*|%3[AaDd]\+?)"  # ":" or "=", also URL-encoded

DIGITS = string.digits
HEX = "0123456789abcdef"
UPPER_DIGITS = string.ascii_uppercase + string.digits
ALNUM = string.ascii_letters + string.digits
URLSAFE = ALNUM + "-_"
BASE64 = ALNUM + "+/"
ALPHABET_WORDS = {DIGITS: "digits", HEX: "hex digits", UPPER_DIGITS: "capitals and digits",
                  ALNUM: "letters and digits", URLSAFE: "letters, digits, `-` and `_`",
                  BASE64: "base64 characters", BASE64 + "\n": "base64 lines", string.ascii_lowercase: "lower-case letters", "pousr": "one letter of `pousr`",
                  "abposr": "one letter of `abposr`"}


@dataclass(frozen=True)
class Chars:
    """A run of ``least``..``most`` characters of ``alphabet``: the random part of a real key."""
    alphabet: str
    least: int
    most: int

    def describe(self) -> str:
        if self.least == self.most == 1:
            return ALPHABET_WORDS[self.alphabet]
        count = str(self.least) if self.least == self.most else f"{self.least}–{self.most}"
        return f"{count} {ALPHABET_WORDS[self.alphabet]}"


Sample = tuple["str | Chars", ...]  # literal text and random runs, in order


@dataclass(frozen=True)
class Shape:
    """A secret recognised by its own shape, wherever it appears."""
    name: str
    pattern: re.Pattern
    samples: tuple[Sample, ...]  # how real ones are built (the property tests generate from these)
    note: str = ""
    secret_group: int = 0  # the group that is hidden; 0: the whole match
    is_not_secret: Callable[[re.Match], bool] | None = None  # a match that is evidence after all

    def describe(self) -> str:
        def one(sample: Sample) -> str:
            return " + ".join(f"`{part.strip()}`" if isinstance(part, str) else part.describe() for part in sample)
        built = "; ".join(one(sample) for sample in self.samples)
        return f"**{self.name}**: {built}" + (f" ({self.note})" if self.note else "")


_HEX_DIGEST_BEFORE = re.compile(r"(?i)(?:[/\\@]|\w\.|(?:revision|commit|sha1?|hash|snapshot)\W{0,4})$")
_HEX_DIGEST_AFTER = re.compile(r"/|\\(?![ntr])|\.\w")  # "\n" after it is an escape, not a path


def _is_digest(match: re.Match) -> bool:
    """40 hex digits that are a path segment (``snapshots/<sha>/``), a dotted module name
    (``transformers_modules.<sha>.modeling``) or a named revision are a git digest, not a key."""
    text = match.string
    return bool(_HEX_DIGEST_BEFORE.search(text[max(0, match.start() - 12):match.start()])
                or _HEX_DIGEST_AFTER.match(text, match.end()))


SHAPES: tuple[Shape, ...] = (
    Shape("Hugging Face token", re.compile(_START + r"hf_[A-Za-z0-9]{20,}"), (("hf_", Chars(ALNUM, 34, 34)),)),
    Shape("GitHub token, classic", re.compile(_START + r"gh[pousr]_[A-Za-z0-9]{20,}"),
          (("gh", Chars("pousr", 1, 1), "_", Chars(ALNUM, 36, 36)),)),
    Shape("GitHub token, fine-grained", re.compile(_START + r"github_pat_[A-Za-z0-9_]{20,}"),
          (("github_pat_", Chars(ALNUM, 22, 22), "_", Chars(ALNUM, 59, 59)),)),
    Shape("OpenAI key", re.compile(_START + r"sk-[A-Za-z0-9_-]{20,}"),
          (("sk-", Chars(ALNUM, 48, 48)), ("sk-proj-", Chars(URLSAFE, 100, 164)),
           ("sk-svcacct-", Chars(URLSAFE, 100, 164)), ("sk-admin-", Chars(URLSAFE, 100, 164)))),
    Shape("Anthropic key", re.compile(_START + r"sk-ant-[A-Za-z0-9_-]{20,}"),
          (("sk-ant-api03-", Chars(URLSAFE, 93, 93), "AA"), ("sk-ant-admin01-", Chars(URLSAFE, 93, 93), "AA"))),
    Shape("Google API key", re.compile(_START + r"AIza[A-Za-z0-9_-]{35}"), (("AIza", Chars(URLSAFE, 35, 35)),)),
    Shape("AWS access key id", re.compile(_START + r"(?:AKIA|ASIA)[0-9A-Z]{16}(?![0-9A-Z])"),
          (("AKIA", Chars(UPPER_DIGITS, 16, 16)), ("ASIA", Chars(UPPER_DIGITS, 16, 16)))),
    Shape("Slack token", re.compile(_START + r"xox[abposr]-[A-Za-z0-9-]{10,}"),
          (("xox", Chars("abposr", 1, 1), "-", Chars(DIGITS, 10, 13), "-", Chars(DIGITS, 10, 13), "-",
            Chars(ALNUM, 24, 32)),)),
    Shape("Weights & Biases key", re.compile(_START + r"(?:local-)?[0-9a-f]{40}(?![0-9A-Za-z])"),
          ((Chars(HEX, 40, 40),), ("local-", Chars(HEX, 40, 40))),
          note="unless a git digest: a path segment, a dotted module name, after `@`, `revision` or `commit`",
          is_not_secret=_is_digest),
    Shape("JSON Web Token", re.compile(_START + r"eyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]+"),
          (("eyJ", Chars(URLSAFE, 10, 40), ".eyJ", Chars(URLSAFE, 10, 200), ".", Chars(URLSAFE, 20, 86)),)),
    Shape("PEM private key", re.compile(r"(-----BEGIN[A-Z0-9 +%]*?PRIVATE(?: |\+|%20)KEY-----)(.*?)"
                                        r"(?:-----END[A-Z0-9 +%]*?PRIVATE(?: |\+|%20)KEY-----|\Z)", re.S),
          (("-----BEGIN RSA PRIVATE KEY-----\n", Chars(BASE64 + "\n", 64, 1600), "\n-----END RSA PRIVATE KEY-----"),
           ("-----BEGIN OPENSSH PRIVATE KEY-----\n", Chars(BASE64 + "\n", 64, 1600), "\n-----END OPENSSH PRIVATE KEY-----")),
          note="the body, to the END line or, if cut, to the end of the text", secret_group=2),
    # To the literal "@" when there is one (a password may hold "%40", an encoded "@"); to the
    # first "%40" in a URL that is itself encoded.
    Shape("URL credentials", re.compile(r"([A-Za-z][A-Za-z0-9+.-]*(?:://|%3A%2F%2F))"
                                        r"([^\s/@'\"<>]+(?=@)|[^\s/@'\"<>]+?(?=%40))(?:@|%40)"),
          (("postgres://", Chars(ALNUM, 3, 12), ":", Chars(URLSAFE, 8, 40), "@db.internal:5432/app"),
           ("postgres://", Chars(ALNUM, 3, 12), ":", Chars(URLSAFE, 4, 20), "%40", Chars(URLSAFE, 8, 20),
            "@db.internal:5432/app")),
          note="the user and password before `@`", secret_group=2),
    Shape("Authorization header", re.compile(rf"(?i)(authorization['\"]?{_COLON}['\"]?(?:(?:bearer|token|basic|bot){_SPACE})?)"
                                             r"([^\s'\",;}\\]+)"),
          (("Authorization: Basic ", Chars(BASE64, 12, 60)), ("authorization='token ", Chars(ALNUM, 20, 40), "'")),
          note="the credential; the scheme is kept", secret_group=2),
    Shape("Bearer credential", re.compile(rf"(?i)((?:(?<![A-Za-z0-9_])|{_AFTER_ESCAPE})bearer{_SPACE})([A-Za-z0-9._~+/-]{{8,}}=*)"),
          (("Bearer ", Chars(URLSAFE, 20, 80)),), secret_group=2),
)

# ---------------------------------------------------------------------------------------------
# Secrets named by a key. A name is split into words (snake_case, kebab-case, camelCase); it
# names a secret when a word is a password or secret, or when it ends in "key" or "token" after
# a word that makes it a credential: "api_key", "X-Api-Key", "AccountKey", "hf_token", but never
# "pad_token", "embed_tokens", "max_tokens" or a bare "key".
SECRET_WORDS = frozenset({"secret", "secrets", "credential", "credentials", "apikey", "pat", "passphrase"})
PASSWORD_ENDINGS = ("password", "passwd")  # "pgpassword", "db_password"
KEY_QUALIFIERS = frozenset({"api", "private", "access", "secret", "account", "auth", "signing", "encryption",
                            "master", "client", "shared", "subscription", "license", "ssh"})
TOKEN_QUALIFIERS = frozenset({"hf", "hub", "api", "access", "auth", "bearer", "refresh", "id", "session", "github",
                              "gh", "slack", "wandb", "bot", "oauth", "personal", "csrf", "security"})
AMBIGUOUS_NAMES = frozenset({"token"})  # "the BOS token: stop …" is prose: its unquoted plain word stays

_QUOTED = r"""(?:"(?:\\.|[^"\\\n])*"|'(?:\\.|[^'\\\n])*'|\\"(?:(?!\\").)*?\\"|\\'(?:(?!\\').)*?\\')"""
_UNQUOTED = r"""[^\s'",;&)}\]\\]+"""
# A list, tuple or dict value, also pretty-printed over several lines (json.dumps(indent=2)); bounded,
# so an opening bracket that never closes costs a bounded scan, not one to the end of the text.
_BRACKETED = (rf"""\[(?:{_QUOTED}|[^\]"']){{0,2000}}\]|\((?:{_QUOTED}|[^)"']){{0,2000}}\)"""
              rf"""|\{{(?:{_QUOTED}|[^}}"']){{0,2000}}\}}""")
_CLOSING = {"[": "]", "(": ")", "{": "}"}
_NAME_START = rf"(?:(?<![\w.'\"\\-])|{_AFTER_ESCAPE})"  # not from the "n" of "\n"
NAMED_VALUE = re.compile(rf"""
    (?: (?P<kq>\\?["'])(?P<qname>[\w.-]+)(?P=kq)\s*\]?\s*[:=]\s*           # 'name': …  ["NAME"] = …
      | {_NAME_START}(?P<bname>[A-Za-z_][\w-]*(?:\.[A-Za-z_][\w-]*)*)       # name= …  name: …  X-Api-Key: …
        (?:\s*[:=]\s*|%3[DdAa])
      | (?:(?<![\w-])|{_AFTER_ESCAPE})--(?P<fname>[A-Za-z][\w-]*)(?:\s+|=)(?!-)  # --name …  --name=…
    )
    (?P<value>{_QUOTED}|{_BRACKETED}|{_UNQUOTED})""", re.X)
_ITEM = re.compile(rf"(?P<key>{_QUOTED}\s*:)|{_QUOTED}")  # a dict's key is matched too, to be kept
_PLACEHOLDER = re.compile(r"(?i)true|false|none|null|nil|undefined|<[^<>]*>|\$\{?\w+\}?|\*+|\.\.\.|…|\[REDACTED[^\]]*\]|")
_CODE_REFERENCE = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+|[A-Za-z_][\w.]*[(\[]")

# Where a named secret is recognised: (context, example). The property tests embed generated
# names and values in each of these; the docs list them.
NAMED_CONTEXTS: tuple[tuple[str, str], ...] = (
    ("code", 'api_key="…"'), ("code, multi-word", 'password="correct horse battery staple"'),
    ("a dict or JSON", '{"password": "…"}'), ("a list value", '{"password": ["…", "…"]}'),
    ("a tuple or dict value, one level deep, also over several lines", '{"credentials": {"user": "…"}}'),
    ("a subscript", 'os.environ["HF_TOKEN"] = "…"'), ("YAML or a header", "X-Api-Key: …"),
    ("an env dump", "AWS_SECRET_ACCESS_KEY=…"), ("a CLI flag", "--password … / --hub-token=…"),
    ("a connection string", "AccountKey=…;"),
)

# Look-alikes kept byte-identical, and why: the tests check each one.
KEPT: tuple[tuple[str, str], ...] = (
    ('tokenizer.padding_side = "right"', "fix cells and code: names that contain token or key are not secrets"),
    ("model.embed_tokens.weight", "module names"),
    ("pad_token_id: 0", "config keys"),
    ("max_tokens=512 --max-new-tokens 20", "settings whose name only contains token"),
    ("key: value", "a bare `key` names nothing secret"),
    ("token=True, api_key=None, secret: False", "literals: True, False, None, null"),
    ("{'token': '<pad>'}", "placeholders: `<…>`, `$VAR`, `***`"),
    ("the BOS token: stop the tokenizer", "prose: a plain lower-case word after a bare `token`"),
    ("token=args.hub_token", "code references: an unquoted dotted name or call is a variable, not its value"),
    (".cache/huggingface/hub/models--org--m/snapshots/0123456789abcdef0123456789abcdef01234567/config.json",
     "git digests in paths and in `transformers_modules.<sha>.…` module names"),
    ("task-abcdefghijklmnopqrstuvwxyz0123", "a key prefix inside a word"),
)


def _name_words(name: str) -> list[str]:
    """ "X-Api-Key" -> ["x", "api", "key"], "AccountKey" -> ["account", "key"], "HF_TOKEN" -> ["hf", "token"]."""
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name)
    return [word.lower() for word in re.split(r"[_\-.\s]+", spaced) if word]


def is_secret_key(name: str) -> bool:
    """Whether a key (a dict key, an argument, a flag, a header) names a secret."""
    words = _name_words(name)
    if not words:
        return False
    if any(word in SECRET_WORDS or word.endswith(PASSWORD_ENDINGS) for word in words):
        return True
    last, before = words[-1], (words[-2] if len(words) > 1 else None)
    if last == "key":
        return before in KEY_QUALIFIERS
    if last == "token":
        return before is None or before in TOKEN_QUALIFIERS
    return False


def is_secret_env_name(name: str) -> bool:
    upper = name.upper()
    parts = upper.split("_")
    return (upper in SECRET_ENV_NAMES or any(part in SECRET_ENV_PARTS for part in parts)
            or any(part.endswith(SECRET_ENV_ENDINGS) for part in parts))


def _unquote(value: str) -> tuple[str, str, str]:
    """(opening quote, inside, closing quote) of a quoted value; ("", value, "") otherwise."""
    for quote in ('\\"', "\\'", '"', "'"):
        if len(value) >= 2 * len(quote) and value.startswith(quote) and value.endswith(quote):
            return quote, value[len(quote):-len(quote)], quote
    return "", value, ""


def _hidden(value: str) -> str:
    """A value with its inside replaced, quotes kept; placeholders and literals stay."""
    opening, inside, closing = _unquote(value)
    if _PLACEHOLDER.fullmatch(inside.strip()):
        return value
    return opening + REDACTED + closing


def _hidden_items(value: str) -> str:
    """ '["a", "b"]' -> '["[REDACTED]", "[REDACTED]"]', the same for a tuple; a dict keeps its keys
    ('{"user": "[REDACTED]"}'); an unquoted flow list or map is hidden whole."""
    opening, inside, closing = value[0], value[1:-1], value[-1]
    if _ITEM.search(inside):
        return opening + _ITEM.sub(lambda m: m.group(0) if m.group("key") else _hidden(m.group(0)), inside) + closing
    return value if _PLACEHOLDER.fullmatch(inside.strip()) else f"{opening}{REDACTED}{closing}"


def _keeps_unquoted(name: str, value: str) -> bool:
    if _PLACEHOLDER.fullmatch(value) or _CODE_REFERENCE.fullmatch(value):
        return True
    return name.lower() in AMBIGUOUS_NAMES and value.isalpha() and value.islower()


def _named_value(match: re.Match) -> str:
    name = match.group("qname") or match.group("bname") or match.group("fname")
    if not is_secret_key(name.rsplit(".", 1)[-1]):
        return match.group(0)
    value = match.group("value")
    if _PLACEHOLDER.fullmatch(value):  # already "[REDACTED:NAME]" (an env value hidden first), or a literal
        return match.group(0)
    if len(value) > 1 and _CLOSING.get(value[0]) == value[-1]:
        shown = _hidden_items(value)
    elif _unquote(value)[0]:
        shown = _hidden(value)
    else:
        shown = value if _keeps_unquoted(name.rsplit(".", 1)[-1], value) else REDACTED
    return match.group(0)[:match.start("value") - match.start()] + shown


# ---------------------------------------------------------------------------------------------
# Home directories: Linux, macOS, Windows (also escaped in JSON), WSL (/mnt/c/Users) and MSYS
# (/c/Users). A user name may have spaces when a path separator follows ("Alice Smith\...").
_USER = r"""(?:[^/\\\s'"<>:]+(?:\ [^/\\\s'"<>:]+)+(?=[/\\])|[^/\\\s'"<>:]+)"""
HOME_DIRS = re.compile(rf"""(?:(?<![\w.-])|{_AFTER_ESCAPE})
    (?:/home/|/Users/|/mnt/[a-z]/Users/|/[a-z]/Users/|[A-Za-z]:(?:\\\\|\\|/)Users(?:\\\\|\\|/))
    (?!(?:Public|Shared|Default)\b){_USER}""", re.X)
HOME_EXAMPLES = ("/home/alice", "/Users/alice", "C:\\Users\\Alice Smith", "/mnt/c/Users/alice", "/c/Users/alice")

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


def _hide_shape(shape: Shape, text: str) -> str:
    def sub(match: re.Match) -> str:
        if shape.is_not_secret is not None and shape.is_not_secret(match):
            return match.group(0)
        if match.group(shape.secret_group).startswith("[REDACTED"):
            return match.group(0)
        start, end = match.start(shape.secret_group) - match.start(), match.end(shape.secret_group) - match.start()
        return match.group(0)[:start] + REDACTED + match.group(0)[end:]
    return shape.pattern.sub(sub, text)


def is_placeholder(value: Any) -> bool:
    return isinstance(value, str) and _PLACEHOLDER.fullmatch(value.strip()) is not None


class Redactor:
    """Redacts strings and nested JSON data; built once from an environment and a home dir."""

    def __init__(self, env: Mapping[str, str] | None = None, *, home: bool | str = True):
        env = os.environ if env is None else env
        secrets = [(value, f"[REDACTED:{name}]") for name, value in env.items()
                   if is_secret_env_name(name) and isinstance(value, str)]
        listed = str(env.get(USER_SECRETS_ENV, "")).split(",")  # "a, b": the space is the separator's
        secrets += [(value.strip(), REDACTED) for value in [*_USER_VALUES, *listed]]
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
        for shape in SHAPES:
            value = _hide_shape(shape, value)
        value = NAMED_VALUE.sub(_named_value, value)
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
                out[key] = self._hidden_data(item) if isinstance(key, str) and is_secret_key(key) else self.data(item)
            return out
        if isinstance(value, list):
            if value and not any(isinstance(v, (str, dict, list)) for v in value):
                return list(value)  # a row of numbers: nothing to redact, skip the per-item walk
            return [self.data(v) for v in value]
        if isinstance(value, tuple):
            return [self.data(v) for v in value]
        return value

    def _hidden_data(self, value: Any) -> Any:
        """The value of a key that names a secret: every string in it, except literals and placeholders."""
        if isinstance(value, str):
            return value if not value or is_placeholder(value) else REDACTED
        if isinstance(value, (list, tuple)):
            return [self._hidden_data(v) for v in value]
        if isinstance(value, dict):
            return {k: self._hidden_data(v) for k, v in value.items()}
        return value


def redact(value: Any, *, env: Mapping[str, str] | None = None, home: bool | str = True) -> Any:
    """A redacted copy of ``value`` (a string or JSON-like data; the input is not changed).

    ``env`` defaults to ``os.environ``; ``home=True`` replaces this user's and every other user's
    home directory with "~", a string names this user's home instead (another root such as
    ``/work/alice``), ``False`` keeps paths as they are.
    """
    return Redactor(env, home=home).data(value)


def spec_markdown() -> str:
    """The list of what is removed and what is kept, for docs/guides/threat-model.md."""
    lines = ["Removed, by shape, wherever it appears (also right after an escape such as `\\n` or `%3D`):", ""]
    lines += [f"- {shape.describe()}" for shape in SHAPES]
    lines += ["", "Removed, by the key that names it: a key whose words include "
              + ", ".join(f"`{w}`" for w in sorted(SECRET_WORDS)) + " or end in "
              + ", ".join(f"`{w}`" for w in PASSWORD_ENDINGS) + "; a key ending in `key` after "
              + ", ".join(f"`{w}`" for w in sorted(KEY_QUALIFIERS)) + "; a key ending in `token` alone or after "
              + ", ".join(f"`{w}`" for w in sorted(TOKEN_QUALIFIERS)) + ". The whole value, in:", ""]
    lines += [f"- {context}: `{example}`" for context, example in NAMED_CONTEXTS]
    lines += ["", "Removed, by environment: the value of every environment variable whose `_`-separated name has a "
              "part " + ", ".join(f"`{p}`" for p in sorted(SECRET_ENV_PARTS)) + " or a part ending in "
              + ", ".join(f"`{s}`" for s in SECRET_ENV_ENDINGS) + ", and "
              + ", ".join(f"`{n}`" for n in sorted(SECRET_ENV_NAMES)) + f", and the values listed in `{USER_SECRETS_ENV}`.",
              "", "Replaced by `~`: home directories, " + ", ".join(f"`{h}`" for h in HOME_EXAMPLES) + ".",
              "", "Kept byte-identical, so the evidence survives:", ""]
    lines += [f"- `{example}`: {why}" for example, why in KEPT]
    return "\n".join(lines) + "\n"
