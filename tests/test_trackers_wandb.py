"""nbguard's scalars, events, alert and report in an offline W&B run, read back from the run's own file."""
import json

import pytest

wandb = pytest.importorskip("wandb")
from trackers_helpers import BAD_STEP, assert_matches_history, plain_run, trainer_run, wandb_records  # noqa: E402


@pytest.fixture
def offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_PROJECT", "nbguard-test")
    yield tmp_path
    wandb.teardown()  # W&B keeps its settings (WANDB_DIR among them) in a process-wide singleton


def _records(root):
    wandb.teardown()  # stops W&B's service process: only then is the run file written out whole
    [path] = root.glob("wandb/offline-run-*/run-*.wandb")
    records = wandb_records(path)
    kinds: dict[str, list] = {}
    for record in records:
        kinds.setdefault(record.WhichOneof("record_type"), []).append(getattr(record, record.WhichOneof("record_type")))
    return kinds


def _history(kinds, step_key: str, prefix: str = "") -> dict[int, dict]:
    """``step_key``'s value -> {key without ``prefix``: value} for each history row that has it."""
    out: dict[int, dict] = {}
    for row in kinds.get("history", []):
        values = {"/".join(item.nested_key) or item.key: json.loads(item.value_json) for item in row.item}
        if step_key in values:
            out.setdefault(int(values[step_key]), {}).update(
                {k[len(prefix):]: v for k, v in values.items() if k.startswith(prefix + "nbguard/")})
    return out


def test_plain_loop_scalars_match_the_watch_history_on_their_own_step_axis(offline):
    run = wandb.init()
    run.log({"user/metric": 1.0})  # the user's own W&B step moves on; nbguard's axis is its own
    watch = plain_run(run, steps=4)
    run.finish()
    kinds = _records(offline)
    logged = _history(kinds, "nbguard/step")
    assert_matches_history({s: {k: v for k, v in row.items() if k != "nbguard/step"} for s, row in logged.items()},
                           watch)
    metrics = {m.glob_name or m.name: m.step_metric for m in kinds["metric"]}
    assert metrics["nbguard/*"] == "nbguard/step"
    assert "alert" not in kinds


def test_plain_loop_planted_nan_is_an_alert_and_a_history_event(offline):
    run = wandb.init()
    plain_run(run, steps=4, bad_step=BAD_STEP, every=10)
    run.finish()
    kinds = _records(offline)
    [alert] = kinds["alert"]
    assert alert.title == "nbguard: nonfinite-grad at step 2" and "model.layers.1.mlp.act_fn" in alert.text
    logged = _history(kinds, "nbguard/step")
    assert sorted(logged) == [0, BAD_STEP]
    assert logged[BAD_STEP]["nbguard/event"].startswith("**nonfinite-grad** at step 2")
    assert logged[BAD_STEP]["nbguard/events/nonfinite-grad"] == 1 and logged[BAD_STEP]["nbguard/skipped_steps"] == 1


def test_trainer_report_to_wandb_alert_scalars_and_report_artifact(offline):
    trainer, watch = trainer_run(["wandb"], steps=4, bad_step=BAD_STEP, output_dir=str(offline / "out"))
    wandb.finish()
    kinds = _records(offline)
    [alert] = kinds["alert"]
    assert alert.title == "nbguard: nonfinite-grad at step 2"
    logged = _history(kinds, "train/global_step", prefix="train/")
    for step in (0, 1, 3):  # the Trainer logs global_step g after the watch's step g - 1
        assert logged[step + 1]["nbguard/loss"] == pytest.approx(watch.history.loss[step], rel=1e-6)
    assert logged[BAD_STEP + 1]["nbguard/event"].startswith("**nonfinite-grad** at step 2")
    [artifact] = kinds["artifact"]
    assert artifact.name == "nbguard-report" and [e.path for e in artifact.manifest.contents] == ["nbguard-report.html"]
