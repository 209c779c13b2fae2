"""nbguard's scalars, event text and alert in a local trackio project, read back from trackio's own storage."""
import os
import sys
import tempfile
import uuid

import pytest

if "trackio" not in sys.modules:  # trackio reads TRACKIO_DIR once, at import: keep the test's data out of ~/.cache
    os.environ.setdefault("TRACKIO_DIR", tempfile.mkdtemp(prefix="nbguard-trackio-"))
trackio = pytest.importorskip("trackio")
from trackers_helpers import BAD_STEP, assert_matches_history, plain_run, trainer_run  # noqa: E402
from trackio.sqlite_storage import SQLiteStorage  # noqa: E402


@pytest.fixture
def project():
    return f"nbguard-{uuid.uuid4().hex[:8]}"


def _logged(project: str, run: str, prefix: str = "") -> dict[int, dict]:
    out: dict[int, dict] = {}
    for row in SQLiteStorage.get_logs(project, run):
        out.setdefault(row["step"], {}).update(
            {k[len(prefix):]: v for k, v in row.items() if k.startswith(prefix + "nbguard/")})
    return out


def test_plain_loop_scalars_match_the_watch_history(project):
    run = trackio.init(project=project, name="healthy")
    watch = plain_run(run, steps=4)
    run.finish()
    assert_matches_history(_logged(project, "healthy"), watch)
    assert SQLiteStorage.get_alerts(project, run_name="healthy") == []


def test_plain_loop_planted_nan_is_an_alert_and_a_logged_event(project):
    run = trackio.init(project=project, name="nan")
    plain_run(run, steps=4, bad_step=BAD_STEP, every=10)
    run.finish()
    [alert] = SQLiteStorage.get_alerts(project, run_name="nan")
    assert alert["title"] == "nbguard: nonfinite-grad at step 2" and alert["step"] == BAD_STEP
    assert "model.layers.1.mlp.act_fn" in alert["text"]
    logged = _logged(project, "nan")
    assert sorted(logged) == [0, BAD_STEP]
    assert logged[BAD_STEP]["nbguard/event"].startswith("**nonfinite-grad** at step 2")
    assert logged[BAD_STEP]["nbguard/events/nonfinite-grad"] == 1


def test_trainer_report_to_trackio_scalars_and_alert(project):
    trainer, watch = trainer_run(["trackio"], steps=4, bad_step=BAD_STEP, run_name="trainer",
                                 project=project)
    [alert] = SQLiteStorage.get_alerts(project, run_name="trainer")
    assert alert["title"] == "nbguard: nonfinite-grad at step 2"
    rows = {row["train/global_step"]: row for row in SQLiteStorage.get_logs(project, "trainer")
            if "train/nbguard/loss" in row}
    for step in (0, 1, 3):  # the Trainer logs global_step g after the watch's step g - 1
        assert rows[step + 1]["train/nbguard/loss"] == pytest.approx(watch.history.loss[step], rel=1e-6)
    assert rows[BAD_STEP + 1]["train/nbguard/event"].startswith("**nonfinite-grad** at step 2")
