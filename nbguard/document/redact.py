"""Remove secrets from a document before anything is written or shown.

Redaction is a scanner over the text, not a set of patterns anchored at a line's start:

1. values of secret-named environment variables and the user's own (``redact_also``, ``NBGUARD_REDACT``);
2. :data:`SHAPES`: secrets recognised by their own shape (a provider's published key format), found by
   their literal prefix wherever it stands and checked to start a token there;
3. secrets named by a key: every occurrence of a word that can name a secret (``key``, ``token``,
   ``secret``, ``password``, …) is widened to the whole name around it (``X-Api-Key``, ``hf_token``,
   ``--hub-token``), the name is judged (:func:`is_secret_key`), and only then is the syntax after it
   read: a quoted name and ``:``/``=`` (dict, JSON, subscript), a bare name and ``:``/``=`` (kwargs, env,
   log line, header, YAML), a flag and a space or ``=`` (CLI). The value ends where that syntax ends it:
   the closing quote, the bracket that closes a list or dict, a comma, brace or whitespace. A name that
   is not a secret's consumes nothing, so ``sent: X-Api-Key: …`` or ``cfg = {"api_key": …}`` is scanned
   on past ``sent`` and ``cfg`` to the name that is;
4. home directories become ``~``.

The specification is data, below: :data:`SHAPES` (with how real ones are built), :data:`NAMED_CONTEXTS`
(the syntaxes a named secret is read from), :data:`KEPT` (look-alikes that must pass through unchanged,
and why). The threat model's list of what is removed (docs/guides/threat-model.md) is
:func:`spec_markdown` of these tables, and the property tests (tests/test_redact_spec.py,
tests/test_redact_scanner.py) generate their keys from the same samples.

Redaction goes by *value* or by a name that really names a secret, never by a name that merely
contains "token" or "key": fix cells (``tokenizer.padding_side = "right"``), module names
(``model.embed_tokens``), config keys (``pad_token_id``), token ids (``pad token: 128001``), digests
and literals (``token=True``) pass through byte-identical. Redact a text whole, then cut it: a token cut
in half no longer has its shape.
"""
from __future__ import annotations

import functools
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
                              "CREDENTIAL", "DSN", "AUTHTOKEN"})
SECRET_ENV_ENDINGS = ("PASSWORD", "PASSWD", "PASSPHRASE")  # libpq's PGPASSWORD has no "_" before it
SECRET_ENV_NAMES = frozenset({"DATABASE_URL", "MYSQL_PWD"})
# A variable whose last part is one of these holds where a secret is, not the secret: HF_TOKEN_PATH.
LOCATION_ENV_PARTS = frozenset({"PATH", "FILE", "DIR", "DIRECTORY", "FOLDER", "HOME", "CACHE", "ROOT"})
MIN_SECRET_LENGTH = 6  # shorter values ("1", "true") would erase ordinary text everywhere

# ---------------------------------------------------------------------------------------------
# Where a secret may start. A token starts a word ("task-…" is no "sk-…" key), but an escape
# sequence right before it is a boundary too: the "n" of "\n" in a repr() or json.dumps() of a
# multi-line string, the "D" of "%3D" in a URL-encoded query, the "m" closing a terminal colour.
# Checked in Python on the few characters before a candidate, so every pattern can start with its
# literal prefix (the regex engine then skips to it instead of trying every position).
_TOKEN_CHARS = frozenset(string.ascii_letters + string.digits + "_-")
_ESCAPE_BEFORE = re.compile(r"(?:\\[ntrfvab0]|%[0-9A-Fa-f]{2}|[\[;]\d{1,2}m)\Z")
_SPACE = r"(?:\s+|\+|%20)"  # a space, also URL-encoded
_COLON = r"(?:\s*[:=]\s*|%3[AaDd]\+?)"  # ":" or "=", also URL-encoded


def _after_escape(text: str, i: int) -> bool:
    return _ESCAPE_BEFORE.search(text, max(0, i - 4), i) is not None


def _starts_token(text: str, i: int, chars: frozenset[str] = _TOKEN_CHARS) -> bool:
    """Whether a token may start at ``text[i]``: nothing of a word before it, or an escape sequence."""
    return i == 0 or text[i - 1] not in chars or _after_escape(text, i)


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
LITERAL_WORDS = {"\n": "a line break"}


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
    """A secret recognised by its own shape, wherever it appears.

    ``literals``: strings one of which a text must hold for the pattern to be tried at all (of the
    lower-cased text when ``fold``); ``starts_token``: a match must start a token (see :func:`_starts_token`)."""
    name: str
    pattern: re.Pattern
    samples: tuple[Sample, ...]  # how real ones are built (the property tests generate from these)
    literals: tuple[str, ...]
    note: str = ""
    secret_group: int = 0  # the group that is hidden; 0: the whole match
    is_not_secret: Callable[[re.Match], bool] | None = None  # a match that is evidence after all
    starts_token: bool = True
    fold: bool = False

    def describe(self) -> str:
        def literal(part: str) -> str:
            return LITERAL_WORDS.get(part) or f"`{part.strip()}`"

        def one(sample: Sample) -> str:
            return " + ".join(literal(part) if isinstance(part, str) else part.describe() for part in sample)
        built = "; ".join(one(sample) for sample in self.samples)
        return f"**{self.name}**: {built}" + (f" ({self.note})" if self.note else "")


def _looks_random(value: str) -> bool:
    """A run of 16+ letters and digits with at least two of each: a generated credential, not a word
    or an identifier (``gpt2-medium``, ``admin``, ``x-access-token``)."""
    for run in re.findall(r"[A-Za-z0-9+/]{16,}", value):
        if sum(c.isdigit() for c in run) >= 2 and sum(c.isalpha() for c in run) >= 2:
            return True
    return False


def _user_only(match: re.Match) -> bool:
    """``ssh://git@host``: a user name and no password is no secret, unless it is itself a generated
    credential (``https://<token>@host``)."""
    userinfo = match.group(2)
    return ":" not in userinfo and "%3a" not in userinfo.lower() and not _looks_random(userinfo)


# An HF token is "hf_" + 34 letters and digits; a terminal or a wrapped log can break it over two
# lines (also as an escaped "\n" in a repr, or "%0A" in a URL).
_LINE_BREAK = r"(?:\r?\n|(?:\\r)?\\n|(?:%0[Dd])?%0[Aa])"
_HF_SPLIT = "|".join(f"[A-Za-z0-9]{{{i}}}{_LINE_BREAK}[A-Za-z0-9]{{{34 - i}}}(?![A-Za-z0-9])" for i in range(34))
_PRIVATE_KEY = r"[A-Z0-9 +%]*?PRIVATE(?: |\+|%20)KEY(?:(?: |\+|%20)BLOCK)?-----"

SHAPES: tuple[Shape, ...] = (
    Shape("Hugging Face token", re.compile(rf"hf_(?:{_HF_SPLIT}|[A-Za-z0-9]{{20,}})"),
          (("hf_", Chars(ALNUM, 34, 34)), ("hf_", Chars(ALNUM, 17, 17), "\n", Chars(ALNUM, 17, 17))),
          ("hf_",), note="also broken over two lines"),
    Shape("GitHub token, classic", re.compile(r"gh[pousr]_[A-Za-z0-9]{20,}"),
          (("gh", Chars("pousr", 1, 1), "_", Chars(ALNUM, 36, 36)),), ("ghp_", "gho_", "ghu_", "ghs_", "ghr_")),
    Shape("GitHub token, fine-grained", re.compile(r"github_pat_[A-Za-z0-9_]{20,}"),
          (("github_pat_", Chars(ALNUM, 22, 22), "_", Chars(ALNUM, 59, 59)),), ("github_pat_",)),
    Shape("OpenAI key", re.compile(r"sk-[A-Za-z0-9_-]{20,}"),
          (("sk-", Chars(ALNUM, 48, 48)), ("sk-proj-", Chars(URLSAFE, 100, 164)),
           ("sk-svcacct-", Chars(URLSAFE, 100, 164)), ("sk-admin-", Chars(URLSAFE, 100, 164))), ("sk-",)),
    Shape("Anthropic key", re.compile(r"sk-ant-[A-Za-z0-9_-]{20,}"),
          (("sk-ant-api03-", Chars(URLSAFE, 93, 93), "AA"), ("sk-ant-admin01-", Chars(URLSAFE, 93, 93), "AA")),
          ("sk-ant-",)),
    Shape("Stripe secret or restricted key", re.compile(r"[sr]k_(?:live|test)_[A-Za-z0-9]{10,}"),
          (("sk_live_", Chars(ALNUM, 24, 99)), ("rk_live_", Chars(ALNUM, 24, 99)), ("sk_test_", Chars(ALNUM, 24, 99)),
           ("rk_test_", Chars(ALNUM, 24, 99))), ("k_live_", "k_test_")),
    Shape("Google API key", re.compile(r"AIza[A-Za-z0-9_-]{35}"), (("AIza", Chars(URLSAFE, 35, 35)),), ("AIza",)),
    Shape("Google OAuth access token", re.compile(r"ya29\.[A-Za-z0-9_-]{20,}"),
          (("ya29.", Chars(URLSAFE, 100, 200)),), ("ya29.",)),
    Shape("AWS access key id", re.compile(r"(?:AKIA|ASIA)[0-9A-Z]{16}(?![0-9A-Z])"),
          (("AKIA", Chars(UPPER_DIGITS, 16, 16)), ("ASIA", Chars(UPPER_DIGITS, 16, 16))), ("AKIA", "ASIA")),
    Shape("Slack token", re.compile(r"xox[abposr]-[A-Za-z0-9-]{10,}"),
          (("xox", Chars("abposr", 1, 1), "-", Chars(DIGITS, 10, 13), "-", Chars(DIGITS, 10, 13), "-",
            Chars(ALNUM, 24, 32)),), ("xox",)),
    Shape("Slack app-level token", re.compile(r"xapp-\d-[A-Za-z0-9-]{10,}"),
          (("xapp-1-", Chars(UPPER_DIGITS, 11, 11), "-", Chars(DIGITS, 13, 13), "-", Chars(HEX, 64, 64)),),
          ("xapp-",)),
    Shape("Slack webhook URL", re.compile(r"(hooks\.slack\.com(?:/|%2[Ff])(?:services|workflows|triggers)(?:/|%2[Ff]))"
                                          r"([A-Za-z0-9_-]+(?:(?:/|%2[Ff])[A-Za-z0-9_-]+)*)"),
          (("https://hooks.slack.com/services/T", Chars(UPPER_DIGITS, 8, 10), "/B", Chars(UPPER_DIGITS, 8, 10), "/",
            Chars(ALNUM, 24, 24)),),
          ("hooks.slack.com",), note="the path after `services/`", secret_group=2, starts_token=False),
    Shape("GitLab token", re.compile(r"gl(?:pat|dt|rt|ptt|cbt|imt|oas|ft|soat|agent)-[A-Za-z0-9_-]{20,}"
                                     r"(?:\.[A-Za-z0-9_-]+)*"),
          (("glpat-", Chars(URLSAFE, 20, 20)), ("glpat-", Chars(URLSAFE, 27, 27), ".01.", Chars(ALNUM, 9, 9))),
          ("gl",)),
    Shape("npm token", re.compile(r"npm_[A-Za-z0-9]{30,}"), (("npm_", Chars(ALNUM, 36, 36)),), ("npm_",)),
    Shape("SendGrid key", re.compile(r"SG\.[A-Za-z0-9_-]{16,}\.[A-Za-z0-9_-]{16,}"),
          (("SG.", Chars(URLSAFE, 22, 22), ".", Chars(URLSAFE, 43, 43)),), ("SG.",)),
    Shape("Twilio API key", re.compile(r"SK[0-9a-fA-F]{32}(?![0-9A-Za-z])"), (("SK", Chars(HEX, 32, 32)),), ("SK",)),
    Shape("Replicate token", re.compile(r"r8_[A-Za-z0-9]{20,}"), (("r8_", Chars(ALNUM, 37, 37)),), ("r8_",)),
    Shape("Groq key", re.compile(r"gsk_[A-Za-z0-9]{20,}"), (("gsk_", Chars(ALNUM, 52, 52)),), ("gsk_",)),
    # 40 hex digits alone are a git digest as often as a W&B key: only where W&B reads one.
    Shape("Weights & Biases key", re.compile(rf"((?:(?i:wandb)(?:{_SPACE}login(?:{_SPACE}--?[\w-]+)*{_SPACE}|\.login(?:\(|%28)"
                                             r"(?:[^()]{0,80}?key(?:\s*=\s*|%3[Dd]))?)(?:['\"]|%2[27])?(?:local-)?|local-))"
                                             r"([0-9a-f]{40})(?![0-9A-Za-z])"),
          (("wandb login ", Chars(HEX, 40, 40)), ("wandb.login(key='", Chars(HEX, 40, 40), "')"),
           ("local-", Chars(HEX, 40, 40))),
          ("wandb", "local-"), note="after `wandb login`, `wandb.login(key=` or `local-`; 40 hex digits elsewhere "
          "are a git digest", secret_group=2, fold=True),
    Shape("JSON Web Token", re.compile(r"eyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]+"),
          (("eyJ", Chars(URLSAFE, 10, 40), ".eyJ", Chars(URLSAFE, 10, 200), ".", Chars(URLSAFE, 20, 86)),), ("eyJ",)),
    Shape("Private key block", re.compile(rf"(-----BEGIN{_PRIVATE_KEY})(.*?)(?:-----END{_PRIVATE_KEY}|\Z)", re.S),
          (("-----BEGIN RSA PRIVATE KEY-----\n", Chars(BASE64 + "\n", 64, 1600), "\n-----END RSA PRIVATE KEY-----"),
           ("-----BEGIN OPENSSH PRIVATE KEY-----\n", Chars(BASE64 + "\n", 64, 1600), "\n-----END OPENSSH PRIVATE KEY-----"),
           ("-----BEGIN PGP PRIVATE KEY BLOCK-----\n\n", Chars(BASE64 + "\n", 64, 1600),
            "\n-----END PGP PRIVATE KEY BLOCK-----")),
          ("-----BEGIN",), note="PEM, OpenSSH or PGP: the body, to the END line or, if cut, to the end of the text",
          secret_group=2, starts_token=False),
    # To the literal "@" when there is one (a password may hold "%40", an encoded "@"); to the
    # first "%40" in a URL that is itself encoded.
    Shape("URL credentials", re.compile(r"([A-Za-z][A-Za-z0-9+.-]*(?:://|%3A%2F%2F))"
                                        r"([^\s/@'\"<>]+(?=@)|[^\s/@'\"<>]+?(?=%40))(?:@|%40)"),
          (("postgres://", Chars(ALNUM, 3, 12), ":", Chars(URLSAFE, 8, 40), "@db.internal:5432/app"),
           ("postgres://", Chars(ALNUM, 3, 12), ":", Chars(URLSAFE, 4, 20), "%40", Chars(URLSAFE, 8, 20),
            "@db.internal:5432/app")),
          ("://", "%3a%2f%2f"), note="the user and password before `@`; a user alone (`ssh://git@host`) is kept",
          secret_group=2, is_not_secret=_user_only, starts_token=False, fold=True),
    Shape("URL signature", re.compile(r"((?:[?&;]|%26|%3[Ff]|&amp;)(?i:sig|x-amz-signature|x-goog-signature)(?:=|%3[Dd]))"
                                      r"([A-Za-z0-9%+/_-]{16,}={0,2})"),
          (("https://acct.blob.core.windows.net/c/b.bin?sv=2022-11-02&se=2026-01-01&sp=r&sig=", Chars(BASE64, 43, 43),
            "%3D"),),
          ("sig=", "sig%3d", "signature=", "signature%3d"), note="an Azure SAS `sig=`, an S3 or GCS signed URL's "
          "signature", secret_group=2, starts_token=False, fold=True),
    Shape("Authorization header", re.compile(rf"(?i)(authorization['\"]?{_COLON}['\"]?(?:(?:bearer|token|basic|bot){_SPACE})?)"
                                             r"([^\s'\",;}\\]+)"),
          (("Authorization: Basic ", Chars(BASE64, 12, 60)), ("authorization='token ", Chars(ALNUM, 20, 40), "'")),
          ("authorization",), note="the credential; the scheme is kept", secret_group=2, starts_token=False,
          fold=True),
    Shape("Bearer credential", re.compile(rf"(?i)(bearer{_SPACE})([A-Za-z0-9._~+/-]{{8,}}=*)"),
          (("Bearer ", Chars(URLSAFE, 20, 80)),), ("bearer",), secret_group=2, fold=True),
)
_BEARER_BEFORE = frozenset(string.ascii_letters + string.digits + "_")  # "X-Bearer" is still a bearer

# ---------------------------------------------------------------------------------------------
# Secrets named by a key. A name is split into words (snake_case, kebab-case, camelCase); it
# names a secret when a word is a password or secret, or when it ends in "key" or "token" after
# a word that makes it a credential: "api_key", "X-Api-Key", "AccountKey", "hf_token", but never
# "pad_token", "embed_tokens", "max_tokens" or a bare "key"; and never when its last word says it
# holds where or what a secret is, not the secret ("HF_TOKEN_PATH", "secret_name", "token_url").
SECRET_WORDS = frozenset({"secret", "secrets", "credential", "credentials", "apikey", "pat", "passphrase"})
PASSWORD_ENDINGS = ("password", "passwd")  # "pgpassword", "db_password"
KEY_QUALIFIERS = frozenset({"api", "private", "access", "secret", "account", "auth", "signing", "encryption",
                            "master", "client", "shared", "subscription", "license", "ssh"})
TOKEN_QUALIFIERS = frozenset({"hf", "hub", "api", "access", "auth", "bearer", "refresh", "id", "session", "github",
                              "gh", "slack", "wandb", "bot", "oauth", "personal", "csrf", "security"})
NOT_SECRET_LAST_WORDS = frozenset({"path", "file", "filename", "filepath", "dir", "directory", "folder", "name",
                                   "url", "uri", "id", "ids", "type", "length", "len", "size", "count", "env",
                                   "var", "enabled", "required", "prefix", "header"})
AMBIGUOUS_NAMES = frozenset({"token"})  # "the BOS token: stop …", "pad token: 128001" are not secrets
# A value after "name:" that is one of these words is prose ("Secret: the model …"), not a password.
PROSE_WORDS = frozenset("""a an the this that these those it its is are was were be been being not no of for to
    in on at by with from and or but if when then so as we you they he she i our your their my do does did has
    have had can will would should must may might here there what which who how why all any each every some
    only never always also just""".split())
TYPE_NAMES = frozenset({"str", "bytes", "int", "SecretStr", "Any", "Optional"})  # api_key: str

_QUOTED = r"""(?:"(?:\\.|[^"\\\n])*"|'(?:\\.|[^'\\\n])*'|\\"(?:(?!\\").)*?\\"|\\'(?:(?!\\').)*?\\')"""
_UNQUOTED = re.compile(r"""[^\s'",;&)}\]\\]+""")
_TO_LINE_END = re.compile(r"""[^\r\n\\'"]+""")
# A list, tuple or dict value, also pretty-printed over several lines (json.dumps(indent=2)); bounded,
# so an opening bracket that never closes costs a bounded scan, not one to the end of the text.
_BRACKETED = re.compile(rf"""\[(?:{_QUOTED}|[^\]"']){{0,2000}}\]|\((?:{_QUOTED}|[^)"']){{0,2000}}\)"""
                        rf"""|\{{(?:{_QUOTED}|[^}}"']){{0,2000}}\}}""")
_QUOTE_VALUE = {q: re.compile(p) for q, p in (
    ('\\"', r'\\"(?:(?!\\").)*?\\"'), ("\\'", r"\\'(?:(?!\\').)*?\\'"),
    ('"', r'"(?:\\.|[^"\\\n])*"'), ("'", r"'(?:\\.|[^'\\\n])*'"))}
_ITEM = re.compile(rf"(?P<key>{_QUOTED}\s*:)|{_QUOTED}")  # a dict's key is matched too, to be kept
_PLACEHOLDER = re.compile(r"(?i)true|false|none|null|nil|undefined|<[^<>]*>|\$\{?\w+\}?|\*+|\.\.\.|…|\[REDACTED[^\]]*\]|")
_CODE_REFERENCE = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+|[A-Za-z_][\w.]*[(\[]")
_CALL = re.compile(r"[A-Za-z_][\w.]*[(\[]")  # token = tokenizer(text …: a call or a subscript is code
_ANNOTATION = re.compile(r"[A-Za-z_][\w.]*(?:\[[^\]\n=]*\])?(?:[ \t]*\|[ \t]*None)?[ \t]+=(?!=)[ \t]*(?=\S)")

# The words a secret's name holds; each occurrence is widened to the name around it.
_NAME_WORD = re.compile(r"(?i)secret|credential|pass(?:w|phrase)|key|token|pat")
_NAME_CHARS = frozenset(string.ascii_letters + string.digits + "_.-")
_NAME_TAIL = re.compile(r"[A-Za-z0-9_.-]*")
_ESCAPE_PREFIX = re.compile(r"(?:(?<=\\)[ntrfvab0]|(?<=%)[0-9A-Fa-f]{2}|(?<=[\[;])\d{1,2}m)")
_MAX_NAME = 128

# Where a named secret is recognised: (context, example). The property tests embed generated
# names and values in each of these, after any other text; the docs list them.
NAMED_CONTEXTS: tuple[tuple[str, str], ...] = (
    ("code", 'api_key="…"'), ("code, multi-word", 'password="correct horse battery staple"'),
    ("keyword arguments", 'dict(password="…")'),
    ("a dict or JSON, also after other text", 'cfg = {"api_key": "…"}'), ("a list value", '{"password": ["…", "…"]}'),
    ("a tuple or dict value, one level deep, also over several lines", '{"credentials": {"user": "…"}}'),
    ("a subscript", 'os.environ["HF_TOKEN"] = "…"'),
    ("a header, also after other text", "sent: X-Api-Key: …"),
    ("YAML, a name starting its line: to the end of the line", "password: correct horse battery staple"),
    ("a log line", "WARNING:root:api_key=…"), ("an env dump", "env: AWS_SECRET_ACCESS_KEY=…"),
    ("a CLI flag", "--password … / --hub-token=…"), ("a connection string", "AccountKey=…;"),
)

# Look-alikes kept byte-identical, and why: the tests check each one.
KEPT: tuple[tuple[str, str], ...] = (
    ('tokenizer.padding_side = "right"', "fix cells and code: names that contain token or key are not secrets"),
    ("model.embed_tokens.weight", "module names"),
    ("pad_token_id: 0", "config keys"),
    ("max_tokens=512 --max-new-tokens 20", "settings whose name only contains token"),
    ("key: value", "a bare `key` names nothing secret"),
    ("MODEL_KEY=gpt2-medium", "a `key` after a word that is no credential's"),
    ("HF_TOKEN_PATH=/data/.cache/huggingface/token", "where a secret is: a name ending in path, file, dir, url, name, id…"),
    ("token=True, api_key=None, secret: False", "literals: True, False, None, null"),
    ("{'token': '<pad>'}", "placeholders: `<…>`, `$VAR`, `***`"),
    ("pad token: 128001, {'token': 50256}", "token ids: a number after a bare `token`"),
    ("the BOS token: stop the tokenizer", "prose: a plain lower-case word after a bare `token`"),
    ("Secret: the model learns it", "prose: a word such as `the`, `is`, `not` after a secret's name"),
    ("token=args.hub_token", "code references: an unquoted dotted name or call is a variable, not its value"),
    ("commit 0123456789abcdef0123456789abcdef01234567", "git digests: 40 hex digits not named as a W&B key"),
    (".cache/huggingface/hub/models--org--m/snapshots/0123456789abcdef0123456789abcdef01234567/config.json",
     "git digests in paths and in `transformers_modules.<sha>.…` module names"),
    ("ssh://git@github.com/org/repo.git", "a user name with no password in a URL"),
    ("task-abcdefghijklmnopqrstuvwxyz0123", "a key prefix inside a word"),
)


def _name_words(name: str) -> list[str]:
    """ "X-Api-Key" -> ["x", "api", "key"], "AccountKey" -> ["account", "key"], "HF_TOKEN" -> ["hf", "token"]."""
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name)
    return [word.lower() for word in re.split(r"[_\-.\s]+", spaced) if word]


@functools.lru_cache(maxsize=4096)  # the same names come back in every text
def is_secret_key(name: str) -> bool:
    """Whether a key (a dict key, an argument, a flag, a header) names a secret."""
    words = _name_words(name)
    if not words or (len(words) > 1 and words[-1] in NOT_SECRET_LAST_WORDS):
        return False
    if any(word in SECRET_WORDS or word.endswith(PASSWORD_ENDINGS) for word in words):
        return True
    last, before = words[-1], (words[-2] if len(words) > 1 else None)
    if last == "key":
        return before in KEY_QUALIFIERS
    if last == "token":
        return before is None or before in TOKEN_QUALIFIERS
    return False


def _env_secret_kind(name: str) -> str | None:
    """"any": every value of this variable is a secret; "random": only a generated-looking value
    (an unqualified ``*_KEY``: ``MODEL_KEY=gpt2-medium`` is a setting, ``KAGGLE_KEY=<32 hex>`` is not);
    None: not a secret's variable."""
    upper = name.upper()
    if upper in SECRET_ENV_NAMES:
        return "any"
    parts = [part for part in upper.split("_") if part]
    if not parts or parts[-1] in LOCATION_ENV_PARTS:
        return None
    if any(part in SECRET_ENV_PARTS - {"KEY"} or part.endswith(SECRET_ENV_ENDINGS) for part in parts):
        return "any"
    if "KEY" in parts:
        return "any" if is_secret_key(name) else "random"
    return None


def is_secret_env_name(name: str) -> bool:
    return _env_secret_kind(name) is not None


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


def _keeps_unquoted(name: str, value: str, colon: bool) -> bool:
    """An unquoted value after a secret's name that is not its value: a literal, a placeholder, a code
    reference or a variable named for a secret, a type annotation, prose after a colon, a token id or a
    plain word after a bare ``token``."""
    if _PLACEHOLDER.fullmatch(value) or _CODE_REFERENCE.fullmatch(value) or _CALL.match(value) or value in TYPE_NAMES:
        return True
    if value.isidentifier() and is_secret_key(value) and (value.lower() == name.lower() or len(_name_words(value)) > 1):
        return True  # login(token=hf_token), api_key=api_key: a variable named for the secret
    if colon and value.lower() in PROSE_WORDS:
        return True
    if name.lower() in AMBIGUOUS_NAMES:
        return (value.isalpha() and value.islower()) or re.fullmatch(r"-?\d+", value) is not None
    return False


def _at_line_start(text: str, start: int) -> bool:
    """Whether only indentation (or a YAML list's "- ") stands between a line's start and ``start``."""
    i = start
    while i > 0 and text[i - 1] in " \t":
        i -= 1
    if i >= 1 and text[i - 1] == "-" and (i == 1 or text[i - 2] in " \t\n"):
        i -= 1
        while i > 0 and text[i - 1] in " \t":
            i -= 1
    return i == 0 or text[i - 1] in "\r\n" or (text[i - 1] == "n" and i >= 2 and text[i - 2] == "\\")


def _name_at(text: str, hit: re.Match) -> tuple[int, int]:
    """The span of the name around a name word: letters, digits, ``_``, ``.`` and ``-``, less an
    escape's letter before it (the "n" of "\\n", "3D" of "%3D"), ``(-1, end)`` when it is no name
    (longer than any key: a base64 run)."""
    start = hit.start()
    low = max(0, start - _MAX_NAME)
    while start > low and text[start - 1] in _NAME_CHARS:
        start -= 1
    tail = _NAME_TAIL.match(text, hit.end())
    end = tail.end() if tail else hit.end()
    if (start == low and low > 0 and text[start - 1] in _NAME_CHARS) or end - start > _MAX_NAME:
        return -1, end
    escape = _ESCAPE_PREFIX.match(text, start)
    if escape and start > 0 and escape.end() <= hit.start():
        start = escape.end()
    while end > start and text[end - 1] in ".-":
        end -= 1
    return start, end


def _separator(text: str, start: int, end: int) -> tuple[int, str] | None:
    """Where the value after the name ``text[start:end]`` starts, and the separator (":", "=" or " " for
    a flag); None when no value follows (the name is prose or code)."""
    n = len(text)
    quote = text[start - 1] if start > 0 and text[start - 1] in "\"'" else ""
    if quote and start >= 2 and text[start - 2] == "\\":
        quote = "\\" + quote
    k = end
    if quote:
        if not text.startswith(quote, end):
            quote = ""
        else:
            k = end + len(quote)
            while k < n and text[k] in " \t":
                k += 1
            if k < n and text[k] == "]":
                k += 1
    while k < n and text[k] in " \t":
        k += 1
    if text.startswith(("%3D", "%3d", "%3A", "%3a"), k):
        sep, k = ("=" if text[k + 2] in "Dd" else ":"), k + 3
    elif text.startswith("=>", k):  # a Perl, PHP or Ruby hash
        sep, k = "=", k + 2
    elif k < n and text[k] == "=" and not re.match(r"=[ \t'\"]", text[k + 1:k + 3]):  # "==" compares
        sep, k = "=", k + 1
    elif k < n and text[k] == ":" and text[k + 1:k + 2] != ":" and not text.startswith("//", k + 1) \
            and not text.startswith("=", k + 1):
        sep, k = ":", k + 1
    elif k < n and text[k] == ":" and text.startswith("=", k + 1):
        sep, k = "=", k + 2  # walrus
    else:
        return None
    while k < n and text[k] in " \t":
        k += 1
    if sep == ":":
        annotation = _ANNOTATION.match(text, k)  # api_key: str = "…"
        if annotation:
            k = annotation.end()
    return (k, sep) if k < n else None


def _flag_value(text: str, end: int) -> int | None:
    """Where the value of the flag ending at ``end`` starts (``--password …``, ``--password=…``)."""
    n = len(text)
    if end < n and text[end] == "=":
        return end + 1 if end + 1 < n else None
    k = end
    while k < n and text[k] in " \t":
        k += 1
    return k if end < k < n and text[k] != "-" else None


def _value(text: str, at: int, name: str, sep: str, line: bool) -> tuple[int, str | None]:
    """(end of the value at ``at``, what replaces it; None: it stays)."""
    if text.startswith("[REDACTED", at):
        return at, None
    for quote, pattern in _QUOTE_VALUE.items():
        if text.startswith(quote, at):
            closed = pattern.match(text, at)
            if closed:
                shown = _hidden(closed.group(0))
                return closed.end(), (None if shown == closed.group(0) else shown)
            # an unclosed quote (a text cut short): to the end of the line
            rest = re.compile(r"[^\r\n]*").match(text, at + len(quote))
            assert rest is not None
            inside = rest.group(0)
            if not inside.strip() or _PLACEHOLDER.fullmatch(inside.strip()):
                return at, None
            return rest.end(), quote + REDACTED
    if text[at] in "[({":
        bracketed = _BRACKETED.match(text, at)
        if bracketed:
            shown = _hidden_items(bracketed.group(0))
            return bracketed.end(), (None if shown == bracketed.group(0) else shown)
    token = _UNQUOTED.match(text, at)
    if token is None:
        return at, None
    value = token.group(0)
    if _keeps_unquoted(name, value, sep == ":"):
        return at, None
    if line and sep == ":":  # YAML or a header starting its line: the value runs to the line's end
        whole = _TO_LINE_END.match(text, at)
        if whole is not None and whole.end() > token.end():
            return at + len(whole.group(0).rstrip(" \t")), REDACTED
    return token.end(), REDACTED


def _hide_named(text: str) -> str:
    """Every value whose name says it is a secret, in whatever syntax the name stands."""
    if _NAME_WORD.search(text) is None:
        return text
    out: list[str] = []
    done = pos = 0
    while True:
        hit = _NAME_WORD.search(text, pos)
        if hit is None:
            break
        start, end = _name_at(text, hit)
        pos = max(end, hit.end())
        if start < 0:
            continue
        raw = text[start:end]
        flag = raw.startswith("--") and len(raw) > 2 and raw[2] != "-"
        name = raw.lstrip("-.")
        key = name.rsplit(".", 1)[-1]
        if not key or not is_secret_key(key):
            continue
        if flag:
            at = _flag_value(text, end)
            found = (at, "=" if text[end:end + 1] == "=" else " ") if at is not None else None
        else:
            found = _separator(text, start, end)
        if found is None:
            continue
        at, sep = found
        value_end, shown = _value(text, at, key, sep, not flag and _at_line_start(text, start))
        if shown is None:
            continue
        out += [text[done:at], shown]
        done = pos = value_end
    out.append(text[done:])
    return "".join(out)


# ---------------------------------------------------------------------------------------------
# Home directories: Linux, macOS, Windows (also escaped in JSON), WSL (/mnt/c/Users) and MSYS
# (/c/Users). A user name may have spaces when a path separator follows ("Alice Smith\...").
_USER = r"""(?:[^/\\\s'"<>:]+(?:\ [^/\\\s'"<>:]+)+(?=[/\\])|[^/\\\s'"<>:]+)"""
HOME_DIRS = re.compile(rf"""
    (?:/home/|/Users/|/mnt/[a-z]/Users/|/[a-z]/Users/|[A-Za-z]:(?:\\\\|\\|/)Users(?:\\\\|\\|/))
    (?!(?:Public|Shared|Default)\b){_USER}""", re.X)
_HOME_BEFORE = frozenset(string.ascii_letters + string.digits + "_.-")
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


def _hide_shape(shape: Shape, text: str, folded: str) -> str:
    if not any(literal in (folded if shape.fold else text) for literal in shape.literals):
        return text
    chars = _BEARER_BEFORE if shape.name == "Bearer credential" else _TOKEN_CHARS
    out: list[str] = []
    done = pos = 0
    while True:
        match = shape.pattern.search(text, pos)
        if match is None:
            break
        pos = match.start() + 1
        if shape.starts_token and not _starts_token(text, match.start(), chars):
            continue
        if (shape.is_not_secret is not None and shape.is_not_secret(match)) \
                or match.group(shape.secret_group).startswith("[REDACTED"):
            continue
        start, end = match.span(shape.secret_group)
        out += [text[done:start], REDACTED]
        done = end
        pos = max(match.end(), pos)
    if not out:
        return text
    out.append(text[done:])
    return "".join(out)


def _hide_homes(text: str) -> str:
    if "/home/" not in text and "Users" not in text:
        return text

    def sub(match: re.Match) -> str:
        i = match.start()
        if i > 0 and text[i - 1] in _HOME_BEFORE and not _after_escape(text, i):
            return match.group(0)
        return "~"
    return HOME_DIRS.sub(sub, text)


def is_placeholder(value: Any) -> bool:
    return isinstance(value, str) and _PLACEHOLDER.fullmatch(value.strip()) is not None


class Redactor:
    """Redacts strings and nested JSON data; built once from an environment and a home dir."""

    def __init__(self, env: Mapping[str, str] | None = None, *, home: bool | str = True):
        env = os.environ if env is None else env
        secrets = []
        for name, value in env.items():
            kind = _env_secret_kind(name) if isinstance(value, str) else None
            if kind == "any" or (kind == "random" and _looks_random(value)):
                secrets.append((value, f"[REDACTED:{name}]"))
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
        folded = value.lower()
        for shape in SHAPES:
            value = _hide_shape(shape, value, folded)
        value = _hide_named(value)
        if self.home is not None:
            value = self.home.sub("~", value)
        if self.any_home:
            value = _hide_homes(value)
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
              + ", ".join(f"`{w}`" for w in sorted(TOKEN_QUALIFIERS)) + "; never a key whose last word is "
              + ", ".join(f"`{w}`" for w in sorted(NOT_SECRET_LAST_WORDS)) + " (where or what a secret is). "
              "The name is found wherever it stands, after any other text; its whole value, in:", ""]
    lines += [f"- {context}: `{example}`" for context, example in NAMED_CONTEXTS]
    lines += ["", "Removed, by environment: the value of every environment variable whose `_`-separated name has a "
              "part " + ", ".join(f"`{p}`" for p in sorted(SECRET_ENV_PARTS)) + " or a part ending in "
              + ", ".join(f"`{s}`" for s in SECRET_ENV_ENDINGS) + ", and "
              + ", ".join(f"`{n}`" for n in sorted(SECRET_ENV_NAMES)) + f", and the values listed in `{USER_SECRETS_ENV}`; "
              "a name whose last part is " + ", ".join(f"`{p}`" for p in sorted(LOCATION_ENV_PARTS))
              + " holds a place, not a secret; under an unqualified `KEY` (`MODEL_KEY`) only a generated-looking "
              "value (16+ letters and digits, both) is removed.",
              "", "Replaced by `~`: home directories, " + ", ".join(f"`{h}`" for h in HOME_EXAMPLES) + ".",
              "", "Kept byte-identical, so the evidence survives:", ""]
    lines += [f"- `{example}`: {why}" for example, why in KEPT]
    return "\n".join(lines) + "\n"
