"""nbguard's axolotl plugin on the real axolotl (make test-axolotl: its own venv, constraints/axolotl.txt): the
YAML names the plugin, axolotl loads it, builds its own Trainer and trains a tiny local Llama on a local
alpaca-format file through ``load_cfg`` / ``load_datasets`` / ``train``, the Python API its CLI calls."""
from __future__ import annotations

import math
import os

import pytest
import torch
import yaml
from framework_helpers import (
    PLANTED_MODULE,
    LRBlowUp,
    PlantNaN,
    alpaca_rows,
    check_caught_and_rewound,
    final_loss,
    first_step_changed,
    save_tiny_model,
    write_jsonl,
)

pytestmark = pytest.mark.axolotl
os.environ.setdefault("AXOLOTL_DO_NOT_TRACK", "1")  # axolotl's telemetry is on unless opted out: nothing leaves here
pytest.importorskip("axolotl")

from axolotl.cli.args import TrainerCliArgs  # noqa: E402
from axolotl.cli.config import load_cfg  # noqa: E402
from axolotl.common.datasets import load_datasets  # noqa: E402
from axolotl.integrations.base import BasePlugin, PluginManager  # noqa: E402
from axolotl.train import setup_model_and_trainer, train  # noqa: E402

from nbguard.watcher.integrations.axolotl import PLUGIN_PATH  # noqa: E402

STEPS = 6
# what the framework-side plugin below plants, set by each test: a NaN/inf at step "at", an LR blow-up from "blow_up_at"
PLANT = {"at": None, "kind": "nan", "blow_up_at": None}


class PlantPlugin(BasePlugin):
    """A user's own axolotl plugin: hands axolotl's Trainer a callback that makes a module's output NaN/inf, or
    one that blows its learning rate up for a few steps."""

    def add_callbacks_post_trainer(self, cfg, trainer):
        plants = [PlantNaN(PLANT["at"], PLANT["kind"])] if PLANT["at"] is not None else []
        return plants + ([LRBlowUp(PLANT["blow_up_at"])] if PLANT["blow_up_at"] is not None else [])


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("axolotl")
    return save_tiny_model(root / "model"), write_jsonl(root / "tiny.jsonl", alpaca_rows())


def run_axolotl(files, tmp_path, *, plugins=(), **overrides):
    """axolotl's CLI path in-process: the YAML, load_cfg, load_datasets, train; returns (model, trainer, cfg)."""
    model_dir, data = files
    config = {
        "base_model": str(model_dir), "datasets": [{"path": str(data), "ds_type": "json", "type": "alpaca"}],
        "output_dir": str(tmp_path / "out"), "dataset_prepared_path": str(tmp_path / "prepared"),
        "sequence_len": 64, "micro_batch_size": 4, "gradient_accumulation_steps": 1, "max_steps": STEPS,
        "learning_rate": 1e-3, "optimizer": "adamw_torch", "lr_scheduler": "constant", "val_set_size": 0,
        "save_strategy": "no", "logging_steps": 1, "seed": 0, "bf16": False, "fp16": False, "dataset_num_proc": 1,
        **({"plugins": ["test_axolotl_entry.PlantPlugin", *plugins]}), **overrides,
    }
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "config.yml"
    path.write_text(yaml.safe_dump(config))
    # axolotl's PluginManager is a process-wide singleton whose hooks run every plugin it ever loaded: start each
    # run from the plugins its own config names, as a fresh `axolotl train` process does
    PluginManager.get_instance().plugins.clear()
    cfg = load_cfg(str(path))
    model, _, trainer = train(cfg=cfg, dataset_meta=load_datasets(cfg=cfg, cli_args=TrainerCliArgs()))
    return model, trainer


def the_watch():
    return PluginManager.get_instance().plugins[PLUGIN_PATH].watch


def losses(trainer):
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def test_a_healthy_run_is_bit_identical_to_an_unwatched_one_and_quiet(files, tmp_path):
    twin, twin_trainer = run_axolotl(files, tmp_path / "twin")
    model, trainer = run_axolotl(files, tmp_path / "watched", plugins=[PLUGIN_PATH])
    watch = the_watch()
    assert watch.trainer is trainer and watch.events == []
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))
    assert losses(trainer) == losses(twin_trainer) and trainer.state.global_step == twin_trainer.state.global_step == STEPS
    assert watch.history.loss == pytest.approx(losses(trainer), rel=1e-4)


def test_a_nan_planted_at_a_step_is_found_there_in_its_module_and_skip_keeps_the_run_going(files, tmp_path):
    PLANT.update(at=3, kind="nan")
    model, trainer = run_axolotl(files, tmp_path, plugins=[PLUGIN_PATH], nbguard_policy="skip")
    watch = the_watch()
    bad = [e for e in watch.events if e.kind.startswith("nonfinite")]
    assert [(e.kind, e.step) for e in bad] == [("nonfinite-loss", 3)]
    assert bad[0].origins[0].module == PLANTED_MODULE
    assert watch.history.skipped_steps == [3]
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert trainer.state.global_step == STEPS  # axolotl's own count: the skipped step still counts


def test_rewind_on_a_nan_caught_before_the_update_drops_it_and_the_run_ends_finite(files, tmp_path):
    PLANT.update(at=5, kind="nan")
    model, trainer = run_axolotl(files, tmp_path, plugins=[PLUGIN_PATH], nbguard_policy="rewind",
                                 nbguard_rewind_every=2)
    bad = [e for e in the_watch().events if e.kind.startswith("nonfinite")]
    assert [(e.kind, e.step) for e in bad] == [("nonfinite-loss", 5)]
    # the watch reads the step before the optimizer moves: the weights are still finite, nothing to restore
    assert bad[0].evidence["rewind"]["restored"] is False and "nothing to undo" in bad[0].evidence["rewind"]["reason"]
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert trainer.state.global_step == STEPS


BLOW_UP_AT = 20
# 40 optimizer steps of 2 accumulated micro-batches (10 epochs of the 32 rows): enough healthy steps before the
# blow-up for the watch's baseline, enough after it for the rewound run to learn again. No dataloader worker:
# axolotl's default (one, spawned) starts a process each epoch, seconds apiece here; the batches are the same.
BLOW_UP_RUN = {"max_steps": 40, "gradient_accumulation_steps": 2, "dataloader_num_workers": 0}


def scheduler_of(trainer):
    return getattr(trainer.lr_scheduler, "scheduler", trainer.lr_scheduler)  # accelerate's wrapper, where there is one


@pytest.fixture(scope="module")
def blow_up(files, tmp_path_factory):
    """One LR blow-up (x1000 for optimizer steps 20-22) in axolotl's Trainer, three runs: (healthy, spiked,
    rewound) as (model, trainer), and the watch; the first two unwatched."""
    out = tmp_path_factory.mktemp("blow-up")
    PLANT.update(at=None, blow_up_at=None)
    healthy = run_axolotl(files, out / "healthy", **BLOW_UP_RUN)
    PLANT.update(blow_up_at=BLOW_UP_AT)
    try:
        spiked = run_axolotl(files, out / "spiked", **BLOW_UP_RUN)
        rewound = run_axolotl(files, out / "rewound", plugins=[PLUGIN_PATH], nbguard_policy="rewind",
                              nbguard_rewind_every=5, **BLOW_UP_RUN)
    finally:
        PLANT.update(blow_up_at=None)
    return healthy, spiked, rewound, the_watch()


def test_an_lr_blow_up_is_a_divergence_where_it_first_shows_and_rewind_keeps_the_trainers_counts(blow_up):
    (_, healthy), (_, spiked), (model, rewound), watch = blow_up
    rewinds = check_caught_and_rewound(watch, losses(healthy), losses(spiked), BLOW_UP_AT, model)
    # axolotl's Trainer's own counts: every optimizer step taken, as many micro-batches drawn, the scheduler at
    # the same place in its schedule, its base LR cut as each rewind says
    assert rewound.state.global_step == healthy.state.global_step == BLOW_UP_RUN["max_steps"]
    assert rewound.state.epoch == healthy.state.epoch
    assert rewound.args.gradient_accumulation_steps == BLOW_UP_RUN["gradient_accumulation_steps"]
    assert scheduler_of(rewound).last_epoch == scheduler_of(healthy).last_epoch
    cut = math.prod(e.evidence["lr_factor"] for e in rewinds)  # each rewind's own cut, as its event says
    assert scheduler_of(rewound).base_lrs == pytest.approx([lr * cut for lr in scheduler_of(healthy).base_lrs])


def test_rewind_brings_an_lr_blow_up_back_within_a_quarter_of_the_healthy_final_loss(blow_up):
    (_, healthy), (_, spiked), (_, rewound), _ = blow_up
    assert final_loss(losses(spiked)) > 1.25 * final_loss(losses(healthy))
    # the bad schedule's step 22 blows up again after the first rewind and is rewound at step 23: within 25% only
    # where that second rewind does not cut the LR again (+25.7% where it did: LR x0.25)
    assert abs(final_loss(losses(rewound)) - final_loss(losses(healthy))) <= 0.25 * final_loss(losses(healthy))


def test_the_plugin_refuses_a_policy_it_does_not_have_when_axolotl_loads_the_config(files, tmp_path):
    with pytest.raises(ValueError, match="policy='sometimes'"):
        run_axolotl(files, tmp_path, plugins=[PLUGIN_PATH], nbguard_policy="sometimes")


def test_bf16_auto_without_bf16_is_audited_as_the_float16_run_it_is_and_its_crash_predicted(files, tmp_path):
    """axolotl's example `bf16: auto` on a machine without bf16 (this CPU) loads the weights in float16 and sets
    fp16=True, which the CPU ignores: the audit of the Trainer axolotl built names the weights' dtypes and the
    first forward's dtype clash, and train() then fails with it."""
    import nbguard

    PLANT.update(at=None)
    model_dir, data = files
    config = {
        "base_model": str(model_dir), "datasets": [{"path": str(data), "ds_type": "json", "type": "alpaca"}],
        "output_dir": str(tmp_path / "out"), "dataset_prepared_path": str(tmp_path / "prepared"), "sequence_len": 64,
        "micro_batch_size": 4, "max_steps": 2, "learning_rate": 1e-3, "optimizer": "adamw_torch", "val_set_size": 0,
        "save_strategy": "no", "bf16": "auto", "dataset_num_proc": 1,
    }
    (tmp_path / "config.yml").write_text(yaml.safe_dump(config))
    PluginManager.get_instance().plugins.clear()
    cfg = load_cfg(str(tmp_path / "config.yml"))
    trainer, model, *_ = setup_model_and_trainer(cfg, load_datasets(cfg=cfg, cli_args=TrainerCliArgs()))
    assert trainer.args.fp16 and torch.float16 in {p.dtype for p in model.parameters()}
    result = nbguard.audit(trainer)
    ignored = result.finding("precision-flag-ignored")
    assert "fp32" not in ignored.title and "float16" in ignored.evidence["effective"]
    crash = result.finding("forward-returns-no-loss")
    assert crash is not None and "dtype" in crash.evidence["exception"]
    with pytest.raises(RuntimeError, match="dtype"):
        trainer.train()
