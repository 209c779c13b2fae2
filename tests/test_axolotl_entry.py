"""nbguard's axolotl plugin on the real axolotl (make test-axolotl: its own venv, constraints/axolotl.txt): the
YAML names the plugin, axolotl loads it, builds its own Trainer and trains a tiny local Llama on a local
alpaca-format file through ``load_cfg`` / ``load_datasets`` / ``train``, the Python API its CLI calls."""
from __future__ import annotations

import os

import pytest
import torch
import yaml
from framework_helpers import PLANTED_MODULE, PlantNaN, alpaca_rows, save_tiny_model, write_jsonl

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
PLANT = {"at": None, "kind": "nan"}  # what the framework-side plugin below plants, set by each test


class PlantPlugin(BasePlugin):
    """A user's own axolotl plugin: hands axolotl's Trainer a callback that makes a module's output NaN/inf."""

    def add_callbacks_post_trainer(self, cfg, trainer):
        return [PlantNaN(PLANT["at"], PLANT["kind"])] if PLANT["at"] is not None else []


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
