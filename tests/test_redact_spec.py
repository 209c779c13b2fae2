"""Redaction as a specification: keys generated from each provider's real alphabet and lengths
(``SHAPES`` samples) and secrets named by real key names, embedded in the contexts they leak from
(a repr() of a multi-line string, json.dumps, a URL-encoded query, a terminal colour code, code,
JSON, YAML, CLI flags, env dumps), are gone; the look-alikes in ``KEPT`` and git digests stay; the
threat model's list is the table rendered."""
from __future__ import annotations

import json
import re
import string
import urllib.parse
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from nbguard.document.redact import (
    KEPT,
    SHAPES,
    Chars,
    Shape,
    is_placeholder,
    is_secret_env_name,
    is_secret_key,
    redact,
    spec_markdown,
)

REPO = Path(__file__).resolve().parent.parent
WINDOW = 8  # the measure: a leak is any 8 characters of a secret left in the output
PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def key_from(sample) -> st.SearchStrategy[tuple[str, list[str]]]:
    """A key built like the sample, and its random runs (the parts that are secret)."""
    parts = [st.just(part) if isinstance(part, str) else st.text(part.alphabet, min_size=part.least, max_size=part.most)
             for part in sample]
    secret_runs = [i for i, part in enumerate(sample) if isinstance(part, Chars)]
    return st.tuples(*parts).map(lambda built: ("".join(built), [built[i] for i in secret_runs]))


def shape_keys(shape: Shape) -> st.SearchStrategy[tuple[str, list[str]]]:
    return st.one_of(*(key_from(sample) for sample in shape.samples))


# Where a key leaks from, as the user's text shows it.
SHAPE_CONTEXTS = {
    "bare": lambda k: k,
    "in prose": lambda k: f"401 Unauthorized for key {k} (check it)",
    "quoted": lambda k: f"login(token='{k}')",
    "repr of a multi-line string": lambda k: repr(f"first line\n{k}\nlast line"),
    "json.dumps with a tab": lambda k: json.dumps({"log": f"step 1\t{k}"}),
    "URL-encoded query": lambda k: "https://example.com/?" + urllib.parse.urlencode({"q": f"auth={k}"}),
    "terminal colour": lambda k: f"\x1b[1m{k}\x1b[0m",
    "in brackets": lambda k: f"[{k}] ({k})",
}


def leaked(runs: list[str], out: str) -> list[str]:
    """The 8-character windows of the secret runs still in ``out`` (the markers themselves aside)."""
    out = re.sub(r"\[REDACTED[^\]]*\]", "\x00", out)
    return [run[i:i + WINDOW] for run in runs for i in range(len(run) - WINDOW + 1) if run[i:i + WINDOW] in out]


@pytest.mark.parametrize("context", SHAPE_CONTEXTS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
def test_every_shape_is_gone_in_every_context(shape, context):
    @PROPERTY
    @given(shape_keys(shape))
    def check(key_and_runs):
        key, runs = key_and_runs
        text = SHAPE_CONTEXTS[context](key)
        kept = key
        for run in runs:
            kept = kept.replace(run, "", 1)
        # the context and the key's own kept parts do not hold the run (a run "0000orizatio" is in "Authorization: ")
        assume(not leaked(runs, SHAPE_CONTEXTS[context](kept)))
        assert not leaked(runs, redact(text, env={})), (text, redact(text, env={}))
    check()


# Real names of secrets (providers' docs and common code); the spec's name rule must cover them.
REAL_SECRET_NAMES = ["password", "db_password", "PGPASSWORD", "aws_secret_access_key", "AWS_SECRET_ACCESS_KEY",
                     "X-Api-Key", "x-api-key", "api_key", "apiKey", "OPENAI_API_KEY", "client_secret", "hf_token",
                     "HF_TOKEN", "access_token", "AccountKey", "SharedAccessKey", "private_key", "passphrase",
                     "use_auth_token", "GH_PAT", "secret_key", "WANDB_API_KEY", "x-auth-token", "token"]
NOT_SECRET_NAMES = ["pad_token", "embed_tokens", "max_tokens", "pad_token_id", "key", "keys", "token_ids", "tokenizer",
                    "max-new-tokens", "bos_token", "eos_token", "use_cache", "KEY_COLUMN", "sort_key"]


@pytest.mark.parametrize("name", REAL_SECRET_NAMES)
def test_real_secret_names_name_a_secret(name):
    assert is_secret_key(name)


@pytest.mark.parametrize("name", NOT_SECRET_NAMES)
def test_names_that_only_contain_token_or_key_do_not(name):
    assert not is_secret_key(name)


def test_libpq_and_mysql_password_variables_are_secret_named():
    assert is_secret_env_name("PGPASSWORD") and is_secret_env_name("MYSQL_PWD") and not is_secret_env_name("PWD")


VALUE_CHARS = string.ascii_letters + string.digits + "!@#%^*+/=~_-"  # no quotes, spaces, separators or "."
# Values a secret can have; the spec's literals and placeholders ("None", "<pad>") are kept on purpose.
unquoted_values = st.text(VALUE_CHARS, min_size=8, max_size=40).filter(
    lambda v: not v.startswith("-") and not is_placeholder(v))
quoted_values = st.text(VALUE_CHARS + " .,;:()[]{}&", min_size=8, max_size=60).filter(
    lambda v: v.strip() == v and not is_placeholder(v))
names = st.sampled_from([n for n in REAL_SECRET_NAMES if n != "token"])  # a bare "token" before a plain word is prose


def kebab(name: str) -> str:
    return re.sub(r"([a-z0-9])([A-Z])", r"\1-\2", name).replace("_", "-").lower()


NAMED_CONTEXTS_BY_FORM = {  # name, value -> text; the forms of redact.NAMED_CONTEXTS
    "quoted": {
        "code": lambda n, v: f'{n}="{v}"',
        "code, single quotes": lambda n, v: f"{n} = '{v}'",
        "a dict or JSON": lambda n, v: json.dumps({n: v, "other": 1}),
        "a list value": lambda n, v: json.dumps({n: [v, v[::-1]]}),
        "a pretty-printed list value": lambda n, v: json.dumps({n: [v, v[::-1]]}, indent=2),
        "a tuple value": lambda n, v: repr({n: (v, v[::-1])}),
        "a dict value": lambda n, v: repr({n: {"user": v, "note": v[::-1]}}),
        "a pretty-printed dict value": lambda n, v: json.dumps({n: {"user": v}}, indent=2),
        "a subscript": lambda n, v: f'os.environ["{n}"] = "{v}"',
        "JSON inside a string": lambda n, v: json.dumps(json.dumps({n: v})),
        "repr of a multi-line string": lambda n, v: repr(f"config:\n{n}='{v}'"),
    },
    "unquoted": {
        "YAML or a header": lambda n, v: f"{n}: {v}\nnext: 1",
        "an env dump": lambda n, v: f"HOME=/tmp\n{n}={v}\nLANG=C",
        "a CLI flag": lambda n, v: f"train.py --{kebab(n)} {v} --epochs 1",
        "a CLI flag with =": lambda n, v: f"train.py --{kebab(n)}={v}",
        "a connection string": lambda n, v: f"Endpoint=sb://x/;{n}={v};EntityPath=q",
        "after an escaped newline": lambda n, v: repr(f"a\n{n}={v}"),
        "a URL query": lambda n, v: f"https://h/p?x=1&{n}={v}&y=2",
    },
}


def named_cases():
    return [(form, context) for form, contexts in NAMED_CONTEXTS_BY_FORM.items() for context in contexts]


@pytest.mark.parametrize(("form", "context"), named_cases())
def test_named_values_are_gone_whole_and_the_name_stays(form, context):
    render = NAMED_CONTEXTS_BY_FORM[form][context]

    @PROPERTY
    @given(names, quoted_values if form == "quoted" else unquoted_values)
    def check(name, value):
        runs = [value, value[::-1]]
        assume(not leaked(runs, render(name, "")) and not leaked(runs, name))
        text = render(name, value)
        out = redact(text, env={})
        assert not leaked(runs, out), (text, out)
        assert kebab(name) in out or name in out or json.dumps(name)[1:-1] in out  # the evidence of what was set
    check()


@given(names, st.lists(quoted_values, min_size=1, max_size=3))
@PROPERTY
def test_every_string_under_a_secret_key_in_data_is_gone(name, values):
    out = json.dumps(redact({name: values, "nested": {name: values[0]}, "model": "m"}, env={}))
    assert not leaked(values, out) and '"model": "m"' in out


@pytest.mark.parametrize(("example", "why"), KEPT)
def test_the_look_alikes_in_the_spec_are_kept_byte_identical(example, why):
    assert redact(example, env={}) == example


DIGEST_CONTEXTS = [
    lambda sha: f"/root/.cache/huggingface/hub/models--org--m/snapshots/{sha}/config.json",
    lambda sha: f"C:\\hf\\snapshots\\{sha}\\model.safetensors",
    lambda sha: f"transformers_modules.microsoft.phi-2.{sha}.modeling_phi",
    lambda sha: f"from_pretrained('org/m', revision='{sha}')",
    lambda sha: f"pip install git+https://github.com/huggingface/transformers@{sha}",
]


@pytest.mark.parametrize("context", range(len(DIGEST_CONTEXTS)))
@given(sha=st.text("0123456789abcdef", min_size=40, max_size=40))
@PROPERTY
def test_git_digests_in_paths_modules_and_revisions_are_evidence_not_keys(context, sha):
    text = DIGEST_CONTEXTS[context](sha)
    assert redact(text, env={}, home=False) == text


@pytest.mark.parametrize("literal", ["token=True", "api_key=None", "secret: False", "pad token: <pad>",
                                     "{'token': '<pad>'}", '"password": null', "--token none",
                                     "hf_token=$HF_TOKEN", "password: '***'"])
def test_literals_and_placeholders_are_not_secrets(literal):
    assert redact(literal, env={}) == literal
    assert redact({"token": "<pad>", "api_key": None, "secret": False}, env={}) == {
        "token": "<pad>", "api_key": None, "secret": False}


@pytest.mark.parametrize(("path", "kept"), [
    ("/mnt/c/Users/alice/run.py", "~/run.py"), ("/c/Users/alice/run.py", "~/run.py"),
    ("C:\\Users\\Alice Smith\\run.py", "~\\run.py"), ('"C:\\\\Users\\\\alice\\\\run.py"', '"~\\\\run.py"'),
    ("'line\\n/home/alice/x'", "'line\\n~/x'"), ("/Users/alice is the user", "~ is the user"),
])
def test_home_directories_of_every_platform_become_tilde(path, kept):
    assert redact(path, env={}) == kept


def test_every_value_in_nbguard_redact_is_removed_without_its_separator_space():
    env = {"NBGUARD_REDACT": "project-alpha, customer-beta ,gamma-team"}
    assert redact("project-alpha customer-beta gamma-team", env=env) == "[REDACTED] [REDACTED] [REDACTED]"


def test_a_pem_private_key_cut_before_its_end_line_is_still_gone():
    pem = "-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkqhkiG9w0BAQEFAASC"
    assert redact(f"key: {pem}", env={}) == "key: -----BEGIN PRIVATE KEY-----[REDACTED]"


MARKERS = ("<!-- generated: nbguard.document.redact.spec_markdown() -->", "<!-- end generated -->")


def test_the_threat_models_list_is_the_spec_rendered():
    page = (REPO / "docs" / "guides" / "threat-model.md").read_text(encoding="utf-8")
    start, end = (page.index(marker) for marker in MARKERS)
    written = page[start + len(MARKERS[0]):end].strip("\n") + "\n"
    assert written == spec_markdown(), ("regenerate the block: .venv/bin/python -c 'from nbguard.document.redact "
                                        "import spec_markdown; print(spec_markdown())'")
    for shape in SHAPES:
        assert shape.name in written
