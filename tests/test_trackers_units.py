"""Dashboard names, folding, bad log_to values, a broken tracker, and no tracker import unless used."""
import math
import subprocess
import sys

import pytest
import torch
from trackers_helpers import plain_run

import nbguard
from nbguard.testing import tiny_llama
from nbguard.trackers.names import MAX_NAME, fold, short_group, short_names
from nbguard.trackers.scalars import StepScalars


def test_short_group_drops_wrappers_and_is_a_pure_function_of_the_name():
    assert short_group("base_model.model.model.layers.3.self_attn") == "layers.3.self_attn"
    assert short_group("model.embed_tokens") == "embed_tokens"
    assert short_group("lm_head") == "lm_head"
    long = "model." + "very_long_module_name." * 5 + "layers.7.mlp"
    short = short_group(long)
    assert len(short) == MAX_NAME - 1 and short.endswith("layers.7.mlp") and short == short_group(long)


def test_short_names_keep_full_names_where_short_ones_collide():
    names = short_names(["model.norm", "base_model.model.norm", "model.layers.0.mlp"])
    assert names == {"model.norm": "model.norm", "base_model.model.norm": "base_model.model.norm",
                     "model.layers.0.mlp": "layers.0.mlp"}


def test_fold_keeps_nonfinite_then_largest_and_folds_the_rest_into_other():
    values = {"a": 1.0, "b": 5.0, "c": float("nan"), "d": 3.0, "e": 4.0, "f": None}
    folded = fold(values, cap=3)
    assert list(folded) == ["c", "b", "other"] and math.isnan(folded["c"])
    assert folded["other"] == pytest.approx(math.sqrt(1 + 9 + 16))
    assert fold({"a": 1.0, "b": None}, cap=3) == {"a": 1.0}
    with pytest.raises(ValueError, match="max_series must be at least 2"):
        fold(values, cap=1)


def test_many_groups_are_capped_with_other_in_the_step_scalars():
    scalars = StepScalars(max_series=4)
    payload = {"step": 0, "loss": 1.0, "grad_norm": {f"model.layers.{i}.mlp": float(i) for i in range(10)}}
    names = [k for k in scalars.of(payload) if k.startswith("nbguard/grad_norm/")]
    assert names == ["nbguard/grad_norm/layers.9.mlp", "nbguard/grad_norm/layers.8.mlp",
                     "nbguard/grad_norm/layers.7.mlp", "nbguard/grad_norm/other"]


@pytest.mark.parametrize("log_to, message", [
    (object(), "log_to must be a TensorBoard SummaryWriter"),
    ("wandb", "the names log_to takes are 'report_to' .* and 'auto'"),
    ("report_to", "log_to='report_to' needs a watched Trainer"),
])
def test_bad_log_to_is_refused_before_any_hook(log_to, message):
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises((TypeError, ValueError), match=message):
        nbguard.watch(model, optimizer=opt, log_to=log_to)
    assert all(not m._forward_hooks_with_kwargs and not m._forward_pre_hooks_with_kwargs for m in model.modules())
    with pytest.raises(ValueError, match="log_every must be a positive int"):
        nbguard.watch(model, optimizer=opt, log_to="report_to", log_every=0)


class _BrokenWriter:
    """Looks like a SummaryWriter to the dispatcher, fails like a full disk."""

    def add_scalar(self, *args):
        raise OSError("No space left on device")


_BrokenWriter.__name__ = "SummaryWriter"
_BrokenWriter.__module__ = "torch.utils.tensorboard.writer"


def test_a_failing_tracker_is_dropped_with_a_watch_error_and_training_goes_on():
    watch = plain_run(_BrokenWriter(), steps=3)
    assert watch.step == 3
    [event] = watch.events
    assert event.kind == "watch-error" and "No space left on device" in event.message


def test_no_tracker_library_is_imported_unless_used():
    code = ("import sys, torch, nbguard, nbguard.trackers\nfrom nbguard.testing import tiny_llama\n"
            "m = tiny_llama(); o = torch.optim.AdamW(m.parameters())\nnbguard.watch(m, optimizer=o, verify=False)\n"
            "print(sorted(k for k in ('wandb', 'mlflow', 'trackio', 'tensorboard', 'torch.utils.tensorboard') "
            "if k in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"
