"""nbguard's metrics, first-event tag and report artifact in a local MLflow store, read back with MlflowClient."""
import pytest

mlflow = pytest.importorskip("mlflow")
from mlflow import MlflowClient  # noqa: E402
from trackers_helpers import BAD_STEP, assert_matches_history, plain_run, trainer_run  # noqa: E402

TAG = "nbguard.first_event"


@pytest.fixture
def store(tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)  # read by mlflow and by the Trainer's MLflowCallback
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "nbguard")
    mlflow.set_tracking_uri(uri)
    mlflow.create_experiment("nbguard", artifact_location=(tmp_path / "artifacts").as_uri())
    mlflow.set_experiment("nbguard")
    yield uri
    while mlflow.active_run() is not None:
        mlflow.end_run()


def _metrics(run_id: str, prefix: str = "") -> dict[int, dict[str, float]]:
    client = MlflowClient()
    out: dict[int, dict[str, float]] = {}
    for key in client.get_run(run_id).data.metrics:
        if key.startswith(prefix + "nbguard/"):
            for point in client.get_metric_history(run_id, key):
                out.setdefault(point.step, {})[key[len(prefix):]] = point.value
    return out


def test_plain_loop_metrics_match_the_watch_history(store):
    with mlflow.start_run() as run:
        watch = plain_run(run, steps=4)
    assert_matches_history(_metrics(run.info.run_id), watch)
    assert TAG not in MlflowClient().get_run(run.info.run_id).data.tags


def test_plain_loop_planted_nan_tags_the_run_with_the_first_event(store):
    with mlflow.start_run() as run:
        plain_run(run, steps=4, bad_step=BAD_STEP, every=10)
    tag = MlflowClient().get_run(run.info.run_id).data.tags[TAG]
    assert tag.startswith("**nonfinite-grad** at step 2") and "model.layers.1.mlp.act_fn" in tag
    logged = _metrics(run.info.run_id)
    assert sorted(logged) == [0, BAD_STEP]
    assert logged[BAD_STEP]["nbguard/events/nonfinite-grad"] == 1 and logged[BAD_STEP]["nbguard/skipped_steps"] == 1


def test_trainer_report_to_mlflow_metrics_tag_and_report_artifact(store, tmp_path):
    trainer, watch = trainer_run(["mlflow"], steps=4, bad_step=BAD_STEP, output_dir=str(tmp_path / "out"))
    client = MlflowClient()
    [run] = client.search_runs([exp.experiment_id for exp in client.search_experiments()])
    assert run.data.tags[TAG].startswith("**nonfinite-grad** at step 2")
    logged = _metrics(run.info.run_id)
    for step in (0, 1, 3):  # the Trainer logs global_step g after the watch's step g - 1
        assert logged[step + 1]["nbguard/loss"] == pytest.approx(watch.history.loss[step], rel=1e-6)
    assert logged[BAD_STEP + 1]["nbguard/events"] == 1
    assert "nbguard-report.html" in [a.path for a in client.list_artifacts(run.info.run_id)]
