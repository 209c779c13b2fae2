"""Redaction as a scanner (issue 40, findings 2, 9 and 10): a secret's name is found after any other
text and in any syntax, its value ends where that syntax ends it; providers' published key formats are
removed wherever they stand; ordinary text (ids, hashes, numbers, UUIDs, prose and code that use the
words token, secret, key, password) comes back byte-identical; a fix cell for a folder under $HOME
still names that folder once the home directory is redacted. The property tests generate the
secrets, the surrounding text and the syntaxes."""
from __future__ import annotations

import json
import os
import re
import string
import uuid

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from nbguard.document.redact import REDACTED, SHAPES, Chars, is_placeholder, redact

PROPERTY = settings(max_examples=200, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
WINDOW = 8  # a leak is any 8 characters of a secret left in the output


def leaked(secret: str, out: str) -> list[str]:
    out = re.sub(r"\[REDACTED[^\]]*\]", "\x00", out)
    return [secret[i:i + WINDOW] for i in range(len(secret) - WINDOW + 1) if secret[i:i + WINDOW] in out]


# ---- finding 2: a secret after any other text --------------------------------------------------
V = "Zq8Wm3Kd9Lp2Xr7T"  # built here, not a real secret


@pytest.mark.parametrize(("text", "expected"), [
    (f"sent: X-Api-Key: {V}", f"sent: X-Api-Key: {REDACTED}"),
    (f'cfg = {{"api_key": "{V}"}}', f'cfg = {{"api_key": "{REDACTED}"}}'),
    (f'headers = {{"X-Api-Key": "{V}"}}', f'headers = {{"X-Api-Key": "{REDACTED}"}}'),
    (f'dict(password="{V}")', f'dict(password="{REDACTED}")'),
    (f"WARNING:root:api_key={V}", f"WARNING:root:api_key={REDACTED}"),
    (f"INFO: password={V}", f"INFO: password={REDACTED}"),
    (f"env: DB_PASSWORD={V}", f"env: DB_PASSWORD={REDACTED}"),
    (f"cmd: --password {V}", f"cmd: --password {REDACTED}"),
    # a harmless name first does not take the rest of the line as its value
    (f"user: bob, api_key={V}, retries=3", f"user: bob, api_key={REDACTED}, retries=3"),
    (f"note = 'x' token={V} step=4", f"note = 'x' token={REDACTED} step=4"),
    (f"Thread 7: File train.py, line 3, in f: client(api_key='{V}')",
     f"Thread 7: File train.py, line 3, in f: client(api_key='{REDACTED}')"),
    (f'api_key: str = "{V}"', f'api_key: str = "{REDACTED}"'),
    (f"password: correct horse {V}\nnext: 1", f"password: {REDACTED}\nnext: 1"),  # YAML: to the line's end
    (f"- password: correct horse {V}\n", f"- password: {REDACTED}\n"),  # a YAML list item
])
def test_a_secret_after_other_text_is_removed_and_the_rest_kept(text, expected):
    assert redact(text, env={}, home=False) == expected


# ---- finding 9: over-redaction --------------------------------------------------------------------
SHA = "0123456789abcdef0123456789abcdef01234567"


@pytest.mark.parametrize("text", [
    "pad token: 128001", "{'token': 50256}", '{"token": -100}', "Secret: the model learns to stop early",
    f"the regression came in with {SHA}, reverted since", f"{SHA}", "HF_TOKEN_PATH=/root/.cache/huggingface/token",
    "MODEL_KEY=gpt2-medium", "ssh://git@github.com/org/repo.git", "git clone git@github.com:org/repo.git",
    'token = tokenizer(text)["input_ids"]', "Password: not set", "api_key: Optional[str] = None",
    "login(token=hf_token)", "client = OpenAI(api_key=OPENAI_API_KEY)",
])
def test_ordinary_text_the_old_patterns_broke_is_byte_identical(text):
    env = {"HF_TOKEN_PATH": "/root/.cache/huggingface/token", "MODEL_KEY": "gpt2-medium"}
    assert redact(text, env=env, home=False) == text


def test_path_and_setting_variables_are_no_secrets_but_generated_keys_still_are():
    kaggle = "".join(string.hexdigits[(7 * i) % 16] for i in range(32))
    env = {"HF_TOKEN_PATH": "/data/token", "MODEL_KEY": "gpt2-medium", "KAGGLE_KEY": kaggle, "MY_SERVICE_TOKEN": "svc-123456"}
    out = redact(f"/data/token gpt2-medium {kaggle} svc-123456", env=env, home=False)
    assert out == "/data/token gpt2-medium [REDACTED:KAGGLE_KEY] [REDACTED:MY_SERVICE_TOKEN]"


def test_a_named_w_and_b_key_is_still_removed():
    for text in (f"wandb login {SHA}", f"wandb.login(key='{SHA}')", f"WANDB_API_KEY={SHA}", f"local-{SHA}"):
        assert SHA not in redact(text, env={}, home=False), text


# ---- finding 10: providers' published formats -----------------------------------------------------
def _run(alphabet: str, n: int, seed: int = 3) -> str:
    return "".join(alphabet[(seed * i * i + 5 * i + seed) % len(alphabet)] for i in range(n))


ALNUM = string.ascii_letters + string.digits
PROVIDER_KEYS = {
    "Stripe live": "sk_live_" + _run(ALNUM, 24), "Stripe restricted": "rk_live_" + _run(ALNUM, 99),
    "Stripe test": "sk_test_" + _run(ALNUM, 24),
    "Slack app": "xapp-1-A0" + _run(string.ascii_uppercase + string.digits, 9) + "-" + _run(string.digits, 13) + "-"
                 + _run("0123456789abcdef", 64),
    "npm": "npm_" + _run(ALNUM, 36), "GitLab": "glpat-" + _run(ALNUM + "-_", 20),
    "SendGrid": "SG." + _run(ALNUM + "-_", 22) + "." + _run(ALNUM + "-_", 43),
    "Twilio": "SK" + _run("0123456789abcdef", 32), "Replicate": "r8_" + _run(ALNUM, 37),
    "Groq": "gsk_" + _run(ALNUM, 52), "Google OAuth": "ya29." + _run(ALNUM + "-_", 120),
}


@pytest.mark.parametrize("provider", PROVIDER_KEYS)
def test_provider_keys_are_removed_wherever_they_stand(provider):
    key = PROVIDER_KEYS[provider]
    for text in (key, f"client = Client('{key}')", f"error 401 for {key}: retry", json.dumps({"note": f"k={key}"})):
        out = redact(text, env={}, home=False)
        assert not leaked(key[4:], out), (provider, text, out)


def test_slack_webhooks_and_signed_urls_lose_their_secret_part():
    hook = "https://hooks.slack.com/services/T0ABCDEF1/B0ABCDEF2/" + _run(ALNUM, 24)
    assert redact(f"posting to {hook} failed", env={}) == \
        f"posting to https://hooks.slack.com/services/{REDACTED} failed"
    sig = _run(ALNUM + "%", 43) + "%3D"
    url = f"https://acct.blob.core.windows.net/c/b.bin?sv=2022-11-02&sp=r&sig={sig}&se=2026"
    assert redact(url, env={}) == url.replace(sig, REDACTED)


def test_a_pgp_private_key_block_is_removed():
    body = "\n".join(_run(ALNUM + "+/", 64, seed) for seed in range(5))
    block = f"-----BEGIN PGP PRIVATE KEY BLOCK-----\n\n{body}\n=abcd\n-----END PGP PRIVATE KEY BLOCK-----"
    out = redact(f"key:\n{block}\nend", env={})
    assert out == f"key:\n-----BEGIN PGP PRIVATE KEY BLOCK-----{REDACTED}-----END PGP PRIVATE KEY BLOCK-----\nend"


@pytest.mark.parametrize("at", [1, 5, 19, 20, 30, 33])
@pytest.mark.parametrize("brk", ["\n", "\r\n", "\\n"])
def test_an_hf_token_broken_over_two_lines_is_removed(at, brk):
    rest = _run(ALNUM, 34)
    text = f"login failed: hf_{rest[:at]}{brk}{rest[at:]}\nnext line"
    out = redact(text, env={})
    assert not leaked(rest, out.replace(brk, "")), out
    assert out.endswith("\nnext line")


# ---- a fix cell for a folder under $HOME -------------------------------------------------------------
def test_the_save_tokenizer_cell_for_a_home_folder_saves_there_after_redaction(tmp_path, monkeypatch):
    from chat_helpers import chat_tokenizer

    import nbguard.fixes as fixes

    home = tmp_path / "home" / "alice"
    home.mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    cell = redact(fixes.code("save-tokenizer", tokenizer="tok", path=str(home / "runs" / "adapter")), env={})
    assert str(home) not in cell and "os.path.expanduser('~/runs/adapter')" in cell
    exec(compile(cell, "<fix cell>", "exec"), {"tok": chat_tokenizer()})  # noqa: S102 - the cell nbguard inserts
    assert (home / "runs" / "adapter" / "tokenizer_config.json").exists()
    assert not (tmp_path / "~").exists()
    outside = fixes.code("save-tokenizer", tokenizer="tok", path="/data/adapter")
    assert "save_pretrained('/data/adapter')" in outside and "expanduser" not in outside
    merge = redact(fixes.code("merge-in-fp32", model="m", path="/data/merged", base=str(home / "models" / "base")), env={})
    assert "import os\n" in merge and "from_pretrained(os.path.expanduser('~/models/base')" in merge
    assert "from_pretrained('org/base'" in fixes.code("merge-in-fp32", model="m", path="/data/merged", base="org/base")


# ---- property tests: secrets in random text and syntaxes ---------------------------------------------
SECRET_NAMES = ["password", "db_password", "PGPASSWORD", "aws_secret_access_key", "AWS_SECRET_ACCESS_KEY", "X-Api-Key",
                "api_key", "apiKey", "OPENAI_API_KEY", "client_secret", "hf_token", "HF_TOKEN", "access_token",
                "AccountKey", "private_key", "passphrase", "GH_PAT", "secret_key", "WANDB_API_KEY", "x-auth-token",
                "DB_PASSWORD", "refresh_token", "secret"]
VALUE_CHARS = string.ascii_letters + string.digits + "!@#%^*+/=~_-"
PREFIXES = ["", "sent: ", "INFO: ", "WARNING:root:", "env: ", "cmd: ", "cfg = ", "2026-11-28 17:00:01 | ", "> ",
            "[rank0]: ", "step 12 | loss=0.53 ", "headers = ", "note: key: value; ", "pad token: 128001, ", "x ",
            "user=bob ", "Thread 3 (train.py:40): ", "\t", "run(", "{'model': 'gpt2', "]
SUFFIXES = ["", " (retrying)", "\nnext line", ", status=200", "; done", " ", "\tok", " | step 13"]


def kebab(name: str) -> str:
    return re.sub(r"([a-z0-9])([A-Z])", r"\1-\2", name).replace("_", "-").lower()


SYNTAXES = {  # name, value -> text
    "env or log": lambda n, v: f"{n}={v}",
    "header": lambda n, v: f"{n}: {v}",
    "kwargs": lambda n, v: f'{n}="{v}"',
    "single quotes": lambda n, v: f"{n} = '{v}'",
    "JSON": lambda n, v: json.dumps({"model": "m", n: v}),
    "dict repr": lambda n, v: repr({n: v, "steps": 3}),
    "call": lambda n, v: f"dict({n}='{v}')",
    "flag": lambda n, v: f"--{kebab(n)} {v}",
    "flag with =": lambda n, v: f"--{kebab(n)}={v}",
    "subscript": lambda n, v: f'os.environ["{n}"] = "{v}"',
    "export": lambda n, v: f"export {n}={v}",
    "query": lambda n, v: f"https://h/p?x=1&{n}={v}&y=2",
    "JSON in a string": lambda n, v: json.dumps(json.dumps({n: v})),
}
values = st.text(VALUE_CHARS, min_size=8, max_size=40).filter(lambda v: not v.startswith("-") and not is_placeholder(v))


@PROPERTY
@given(st.sampled_from(SECRET_NAMES), values, st.sampled_from(sorted(SYNTAXES)), st.sampled_from(PREFIXES),
       st.sampled_from(SUFFIXES))
def test_a_named_secret_never_survives_in_any_syntax_after_any_text(name, value, syntax, prefix, suffix):
    text = prefix + SYNTAXES[syntax](name, value) + suffix
    assume(not leaked(value, prefix + SYNTAXES[syntax](name, "") + suffix))
    out = redact(text, env={}, home=False)
    assert not leaked(value, out), (text, out)
    assert out.startswith(prefix) and out.endswith(suffix)  # nothing before or after is taken


def shape_key(shape) -> st.SearchStrategy[tuple[str, list[str]]]:
    def built(sample):
        parts = [st.just(p) if isinstance(p, str) else st.text(p.alphabet, min_size=p.least, max_size=p.most)
                 for p in sample]
        runs = [i for i, p in enumerate(sample) if isinstance(p, Chars)]
        return st.tuples(*parts).map(lambda b: ("".join(b), [b[i] for i in runs]))
    return st.one_of(*(built(sample) for sample in shape.samples))


PLACES = {  # key -> text
    "bare": lambda k: k, "quoted": lambda k: f"'{k}'", "call": lambda k: f"Client({k!r})",
    "under a harmless name": lambda k: f"note={k}", "in JSON": lambda k: json.dumps({"note": f"saw {k}"}),
    "in a log line": lambda k: f"WARNING:root:request with {k} failed",
}


@PROPERTY
@given(st.sampled_from(SHAPES).flatmap(shape_key), st.sampled_from(sorted(PLACES)), st.sampled_from(PREFIXES),
       st.sampled_from(SUFFIXES))
def test_a_provider_shaped_secret_never_survives_in_any_text(key_and_runs, place, prefix, suffix):
    key, runs = key_and_runs
    text = prefix + PLACES[place](key) + suffix
    out = redact(text, env={}, home=False)
    for run in runs:
        assume(not leaked(run, prefix + PLACES[place]("") + suffix))
        assert not leaked(run, out), (text, out)


# ---- property tests: ordinary text comes back byte-identical ---------------------------------------------
WORDS = ["the", "model", "token", "tokens", "secret", "key", "keys", "password", "learns", "stop", "pad", "loss",
         "gradient", "adapter", "is", "not", "a", "of", "to", "and", "layer", "embedding", "tokenizer", "vocab"]
hexes = st.integers(min_value=0, max_value=2 ** 256 - 1).map(lambda i: f"{i:064x}")
shas = hexes.map(lambda h: h[:40])
uuids = st.integers(min_value=0, max_value=2 ** 128 - 1).map(lambda i: str(uuid.UUID(int=i)))
numbers = st.one_of(st.integers(min_value=-10 ** 12, max_value=10 ** 12).map(str),
                    st.floats(allow_nan=False, allow_infinity=False).map(repr))
prose = st.lists(st.sampled_from(WORDS), min_size=1, max_size=12).map(" ".join)
ids = st.lists(st.integers(min_value=0, max_value=200_000), min_size=1, max_size=8)
CODE_LINES = ['tokenizer.padding_side = "right"', "tokenizer.pad_token = tokenizer.eos_token",
              "model.resize_token_embeddings(len(tokenizer))", "for key, value in batch.items():",
              'api_key = os.environ["OPENAI_API_KEY"]', "token = tokenizer(text)['input_ids']",
              "login(token=args.hub_token)", "max_new_tokens=256, pad_token_id=tok.pad_token_id",
              "key = jax.random.PRNGKey(0)", "secret_name = 'prod-db'", "if password is None:",
              "HF_TOKEN_PATH=/data/.cache/huggingface/token", "MODEL_KEY=gpt2-medium", "sort_key=lambda r: r[0]",
              "from transformers import AutoTokenizer", "--max-new-tokens 20 --token none"]
modules = st.lists(st.sampled_from(["model", "layers", "0", "12", "self_attn", "q_proj", "embed_tokens", "lm_head",
                                    "key_proj", "token_type_embeddings", "lora_A", "default", "weight"]),
                   min_size=2, max_size=7).map(".".join)
ordinary = st.one_of(
    prose,
    prose.map(lambda p: p[:1].upper() + p[1:] + "."),
    st.tuples(st.sampled_from(["Secret", "Token", "Password", "Key", "token", "secret"]), prose).map(
        lambda t: f"{t[0]}: the {t[1]}"),
    st.tuples(st.sampled_from(["pad token", "bos token", "token", "eos token"]), st.integers(0, 300_000)).map(
        lambda t: f"{t[0]}: {t[1]}"),
    st.integers(0, 300_000).map(lambda i: repr({"token": i, "text": "hi"})),
    ids.map(lambda xs: f"token ids: {xs}"),
    shas.map(lambda s: f"commit {s}"), shas, hexes.map(lambda h: f"sha256:{h}"), hexes, uuids,
    uuids.map(lambda u: f"run id {u} (key: {u[:8]})"), numbers, numbers.map(lambda n: f"loss={n} step=3"),
    st.sampled_from(CODE_LINES), modules, modules.map(lambda m: f"{m}: grad norm 0.5"),
)


@PROPERTY
@given(st.lists(ordinary, min_size=1, max_size=6), st.sampled_from([" ", "\n", "; ", " | ", ", "]))
def test_ordinary_text_comes_back_byte_identical(parts, sep):
    text = sep.join(parts)
    assert redact(text, env={}, home=False) == text


def test_redaction_keeps_what_it_is_given_when_home_is_another_users():
    text = "saved to /data/runs/adapter with MODEL_KEY=gpt2-medium"
    assert redact(text, env={"HOME": os.path.expanduser("~")}, home="/home/alice") == text


def test_an_api_key_in_a_stall_events_thread_stacks_is_gone_from_the_saved_report(tmp_path):
    """Finding 2's leak through a real document: a thread stack quotes the source lines it stands on."""
    import importlib.util

    from nbguard.findings import document
    from nbguard.reporting import Report

    source = tmp_path / "client_setup.py"
    source.write_text(f'import traceback\n\ndef connect():\n    cfg = {{"api_key": "{V}"}}; headers = {{"X-Api-Key": "{V}"}}; '
                      f'return cfg, headers, "".join(traceback.format_stack())\n', encoding="utf-8")
    spec = importlib.util.spec_from_file_location("client_setup", source)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    stack = module.connect()[2]
    assert V in stack  # the real stack quotes the line
    doc = document("watch", events=[{"kind": "stall", "step": 3, "message": "no optimizer step completed for 60 s",
                                     "cause": None, "origins": [], "evidence": {"stacks": {"MainThread": stack}}}])
    saved = Report.from_dict(doc).save(tmp_path / "report.json").read_text(encoding="utf-8")
    assert V not in saved and '\\"api_key\\": \\"[REDACTED]\\"' in saved
    assert "client_setup.py" in saved and "connect" in saved  # the evidence itself is kept
