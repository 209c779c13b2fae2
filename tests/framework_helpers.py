"""What the axolotl and LLaMA-Factory lanes hand those frameworks: a tiny real Llama and its tokenizer saved to a
folder (as a hub snapshot would be, none is fetched), an alpaca-format instruction set of words the tokenizer
knows, and the framework's own kind of callback that makes one module's output NaN at one optimizer step."""
from __future__ import annotations

import json
from pathlib import Path

from transformers import TrainerCallback

from nbguard.testing import TINY_VOCAB, tiny_llama, word_tokenizer

PLANTED_MODULE = "model.layers.1.mlp"  # the module PlantNaN breaks, named as the watch names it


def save_tiny_model(folder: Path) -> Path:
    """A LlamaForCausalLM and its word tokenizer, saved where a framework's ``model_name_or_path`` points."""
    tiny_llama().save_pretrained(folder)
    word_tokenizer().save_pretrained(folder)
    return folder


def alpaca_rows(count: int = 32, words: int = 6) -> list[dict[str, str]]:
    """Instruction/output pairs of the tokenizer's words (w3..w127), the same every time."""
    def sentence(start: int, stride: int) -> str:
        return " ".join(f"w{3 + (start * stride + j) % (TINY_VOCAB - 3)}" for j in range(words))

    return [{"instruction": sentence(i, 7), "input": "", "output": sentence(i, 5)} for i in range(count)]


def write_jsonl(path: Path, rows: list[dict[str, str]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def nonfinite_in(output, kind: str):
    return output * float(kind)  # float("nan") or float("inf"): every element of the module's output


class PlantNaN(TrainerCallback):
    """Makes ``model.layers[1].mlp``'s output non-finite (``kind``: "nan" or "inf") during optimizer step ``at``."""

    def __init__(self, at: int, kind: str = "nan"):
        self.at, self.kind, self.hook = at, kind, None

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if state.global_step == self.at:
            self.hook = model.model.layers[1].mlp.register_forward_hook(lambda m, a, out: nonfinite_in(out, self.kind))

    def on_step_end(self, args, state, control, **kwargs):
        if self.hook is not None:
            self.hook.remove()
            self.hook = None
