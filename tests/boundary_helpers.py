"""Secrets planted in exception messages, and the substrings that must never reach an exit."""
from __future__ import annotations

from pathlib import Path

HF_TOKEN = "hf_" + "Q7xVb2LmN9pRt4KwZs8YcJd3FgHa6UeMk1"  # hf_ + 34 letters and digits
API_VALUE = "Zk4QmW8rT2yP6nX0"
URL_PASSWORD = "Tr0ub4dor3xyz"
HOME = "/home/alice"
SECRET_MESSAGE = (f"upload failed for https://alice:{URL_PASSWORD}@db.example.com:5432/prod with "
                  f"api_key={API_VALUE} (token {HF_TOKEN}) from {HOME}/finetune/run7")
LEAKS = (HF_TOKEN[3:], API_VALUE, URL_PASSWORD, HOME)


def leaks_in(text: str | bytes) -> list[str]:
    """The planted secrets found in ``text``."""
    if isinstance(text, bytes):
        return [s for s in LEAKS if s.encode() in text]
    return [s for s in LEAKS if s in text]


def leaks_under(root: str | Path) -> dict[str, list[str]]:
    """file -> the planted secrets its bytes hold, for every file under ``root``."""
    out = {}
    for path in Path(root).rglob("*"):
        if path.is_file():
            found = leaks_in(path.read_bytes())
            if found:
                out[str(path)] = found
    return out
