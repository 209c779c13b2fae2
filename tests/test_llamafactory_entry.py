"""``nbguard.callback()`` on the real LLaMA-Factory (make test-llamafactory: its own venv,
constraints/llamafactory.txt): ``run_exp(args, callbacks=[cb])`` builds its own Trainer (stage sft, full
fine-tuning) on a tiny local Llama and a local alpaca-format dataset, trains it, saves it and returns nothing."""
from __future__ import annotations

import json
import math

import pytest
import torch
from framework_helpers import (
    PLANTED_MODULE,
    LRBlowUp,
    PlantNaN,
    SeenAtEnd,
    alpaca_rows,
    check_caught_and_rewound,
    check_trainer_counts_kept,
    final_loss,
    first_step_changed,
    save_tiny_model,
)
from safetensors.torch import load_file

pytestmark = pytest.mark.llamafactory
pytest.importorskip("llamafactory")

from llamafactory.train.tuner import run_exp  # noqa: E402

import nbguard  # noqa: E402
from nbguard.watcher import RewindSettings  # noqa: E402

STEPS = 6


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("llamafactory")
    data = root / "data"
    data.mkdir()
    (data / "tiny.json").write_text(json.dumps(alpaca_rows()))
    (data / "dataset_info.json").write_text(json.dumps({"tiny": {"file_name": "tiny.json"}}))
    return save_tiny_model(root / "model"), data


def train(files, out, callbacks=None, **overrides):
    """LLaMA-Factory's entry point with the arguments its YAML would hold; returns what it left in ``out``:
    the saved weights, the losses it logged and its Trainer's final step."""
    model_dir, data = files
    run_exp({
        "stage": "sft", "do_train": True, "finetuning_type": "full", "model_name_or_path": str(model_dir),
        "dataset": "tiny", "dataset_dir": str(data), "template": "empty", "cutoff_len": 32, "output_dir": str(out),
        "per_device_train_batch_size": 4, "max_steps": STEPS, "learning_rate": 1e-3, "lr_scheduler_type": "constant",
        "logging_steps": 1, "save_strategy": "no", "report_to": "none", "use_cpu": True, "seed": 0,
        "disable_tqdm": True, "overwrite_output_dir": True, **overrides,
    }, callbacks=callbacks)
    state = json.loads((out / "trainer_state.json").read_text())
    losses = [entry["loss"] for entry in state["log_history"] if "loss" in entry]
    return load_file(out / "model.safetensors"), losses, state["global_step"]


def test_a_healthy_run_is_bit_identical_to_an_unwatched_one_and_quiet(files, tmp_path):
    twin, twin_losses, twin_steps = train(files, tmp_path / "twin")
    cb = nbguard.callback(log_to=None, verify=False)
    weights, losses, steps = train(files, tmp_path / "watched", [cb])
    assert weights.keys() == twin.keys() and all(torch.equal(weights[k], twin[k]) for k in weights)
    assert losses == twin_losses and steps == twin_steps == STEPS
    assert cb.watch is not None and cb.watch.events == []
    assert cb.watch.history.loss == pytest.approx(losses, rel=1e-4)


def test_an_inf_planted_at_a_step_is_found_there_in_its_module_and_skip_keeps_the_run_going(files, tmp_path):
    cb = nbguard.callback(policy="skip", log_to=None, verify=False)
    weights, _, steps = train(files, tmp_path, [PlantNaN(at=4, kind="inf"), cb])
    bad = [e for e in cb.watch.events if e.kind.startswith("nonfinite")]
    assert [(e.kind, e.step) for e in bad] == [("nonfinite-loss", 4)]
    assert bad[0].origins[0].module == PLANTED_MODULE
    assert cb.watch.history.skipped_steps == [4]
    assert all(torch.isfinite(w).all() for w in weights.values())
    assert steps == STEPS  # LLaMA-Factory's Trainer still counts the skipped step


BLOW_UP_AT = 20
# 40 optimizer steps of 2 accumulated micro-batches (10 epochs of the 32 rows): enough healthy steps before the
# blow-up for the watch's baseline, enough after it for the rewound run to learn again
BLOW_UP_RUN = {"max_steps": 40, "gradient_accumulation_steps": 2}


@pytest.fixture(scope="module")
def blow_up(files, tmp_path_factory):
    """One LR blow-up (x1000 for optimizer steps 20-22) through run_exp, three runs: (healthy, spiked, rewound,
    the watch); the first two unwatched."""
    out = tmp_path_factory.mktemp("blow-up")
    healthy, spiked, rewound = SeenAtEnd(), SeenAtEnd(), SeenAtEnd()
    train(files, out / "healthy", [healthy], **BLOW_UP_RUN)
    train(files, out / "spiked", [LRBlowUp(BLOW_UP_AT), spiked], **BLOW_UP_RUN)
    cb = nbguard.callback(policy="rewind", rewind=RewindSettings(every=5), log_to=None, verify=False)
    train(files, out / "rewound", [LRBlowUp(BLOW_UP_AT), cb, rewound], **BLOW_UP_RUN)
    return healthy, spiked, rewound, cb.watch


def test_an_lr_blow_up_is_a_divergence_where_it_first_shows_and_rewind_keeps_the_trainers_counts(blow_up):
    healthy, spiked, rewound, watch = blow_up
    rewinds = check_caught_and_rewound(watch, healthy.losses, spiked.losses, BLOW_UP_AT, rewound.model)
    check_trainer_counts_kept(healthy, rewound, rewinds, BLOW_UP_RUN)


def test_rewind_brings_an_lr_blow_up_back_within_a_quarter_of_the_healthy_final_loss(blow_up):
    healthy, spiked, rewound, _ = blow_up
    assert final_loss(spiked.losses) > 1.25 * final_loss(healthy.losses)
    # the bad schedule's step 22 runs at most at the cut LR held after the rewind (without the hold it blew the
    # restored state up again, and a second rewind cut the LR to x0.25: +24.5%)
    assert abs(final_loss(rewound.losses) - final_loss(healthy.losses)) <= 0.25 * final_loss(healthy.losses)
