"""What the axolotl and LLaMA-Factory lanes hand those frameworks: a tiny real Llama and its tokenizer saved to a
folder (as a hub snapshot would be, none is fetched), an alpaca-format instruction set of words the tokenizer
knows, the framework's own kind of callback that makes one module's output NaN at one optimizer step, and one that
blows the learning rate up for a few steps (with how to read the runs it spoils)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
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


class LRBlowUp(TrainerCallback):
    """A bad schedule, as a user meets it: the optimizer's LR multiplied by ``factor`` for optimizer steps
    ``at`` .. ``at + steps - 1``; the Trainer's own scheduler puts it back at its next step."""

    def __init__(self, at: int, steps: int = 3, factor: float = 1000.0):
        self.at, self.steps, self.factor = at, steps, factor

    def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
        if self.at <= state.global_step < self.at + self.steps:
            for group in optimizer.param_groups:
                group["lr"] *= self.factor


def first_step_changed(healthy: list[float], spiked: list[float]) -> int:
    """The first optimizer step whose logged loss differs between two runs that are bit-identical before the
    fault: where the blown-up update first shows (its step + 1, the next forward's)."""
    return next(step for step, (a, b) in enumerate(zip(healthy, spiked)) if a != b)


def final_loss(losses: list[float], last: int = 5) -> float:
    """The run's final loss level: the mean of its last logged losses (one step's batch is noise)."""
    return sum(losses[-last:]) / last


class SeenAtEnd(TrainerCallback):
    """What a framework's Trainer ended with, for runs whose entry point returns nothing of it: its state,
    its arguments, its LR scheduler (unwrapped) and its model."""

    def on_train_end(self, args, state, control, model=None, lr_scheduler=None, **kwargs):
        self.args, self.state, self.model = args, state, model
        self.scheduler = getattr(lr_scheduler, "scheduler", lr_scheduler)  # accelerate's wrapper, where there is one

    @property
    def losses(self) -> list[float]:
        return [entry["loss"] for entry in self.state.log_history if "loss" in entry]


def check_caught_and_rewound(watch, healthy: list[float], spiked: list[float], at: int, model) -> list:
    """What every entry point's LR blow-up (``LRBlowUp(at)``) must show: the blown-up update of step ``at`` first
    shows in the next step's loss (the unwatched spiked twin's first loss that differs from the healthy twin's),
    and the divergence is at that step; nothing before the blow-up; a rewind to a state from before it, on a
    divergence; the weights finite. Returns the rewind events."""
    shows = first_step_changed(healthy, spiked)
    assert shows == at + 1, (shows, at)
    assert not [e for e in watch.events if e.step < at]
    assert [e.step for e in watch.events if e.kind == "divergence"][0] == shows
    rewinds = [e for e in watch.events if e.kind == "rewind"]
    assert rewinds[0].evidence["trigger"] == "divergence"
    assert rewinds[0].evidence["restored_after_step"] < at
    assert all(bool(p.isfinite().all()) for p in model.parameters())
    return rewinds


def check_trainer_counts_kept(healthy: SeenAtEnd, rewound: SeenAtEnd, rewinds: list, run: dict) -> None:
    """The Trainer's own counts after rewinds: every optimizer step taken, as many micro-batches drawn (the skipped
    ones too), the scheduler at the same place in its schedule, its base LR cut as each rewind's event says."""
    assert rewound.state.global_step == healthy.state.global_step == run["max_steps"]
    assert rewound.state.epoch == healthy.state.epoch
    assert rewound.args.gradient_accumulation_steps == run["gradient_accumulation_steps"]
    assert rewound.scheduler.last_epoch == healthy.scheduler.last_epoch
    cut = math.prod(e.evidence["lr_factor"] for e in rewinds)
    assert rewound.scheduler.base_lrs == pytest.approx([lr * cut for lr in healthy.scheduler.base_lrs])
