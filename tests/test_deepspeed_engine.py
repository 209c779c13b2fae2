"""The watch reads DeepSpeed's skipped steps and gradient norm from a real engine: two ZeRO ranks on
DeepSpeed's CPU accelerator (gloo), rank 1's loss made non-finite at planted steps, and what the
watch reported checked against what the engine really did (``tests/deepspeed_ranks.py``).

Needs deepspeed (not in the project's lanes; see docs/guides/ddp.md for how it was installed) and
``DS_ACCELERATOR=cpu``. The first launch on a machine JIT-compiles DeepSpeed's shared-memory comm op
(about two minutes, cached under ~/.cache/torch_extensions)."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

from ddp_helpers import _run, read_ranks  # noqa: E402
from deepspeed_ranks import BAD_STEP, STREAK  # noqa: E402

from nbguard.watcher.distributed.deepspeed_skips import parse_overflow  # noqa: E402

pytestmark = pytest.mark.multirank
HELPER = Path(__file__).with_name("deepspeed_ranks.py")


def _launch(scenario: str, policy: str, out_dir: Path, monkeypatch) -> list[dict]:
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # deepspeed would look for CUDA and fail without it
    done = _run(lambda port: [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                              "127.0.0.1", "--master_port", str(port), str(HELPER), scenario, policy, str(out_dir)],
                stall=300)  # a first launch spends minutes compiling DeepSpeed's comm op
    assert done.returncode == 0, done.stdout[-12000:]
    return read_ranks(out_dir)


def _skipped_by_engine(truth: list[dict]) -> list[int]:
    """The engine steps (0-based) the engine itself skipped, from its own counter."""
    before = 0
    skipped = []
    for i, t in enumerate(truth):
        if t["skipped_steps"] > before:
            skipped.append(i)
        before = t["skipped_steps"]
    return skipped


def _readings_match_engine(result: dict) -> None:
    """One reading per optimizer step, each equal to what the engine said right after that step."""
    readings, truth = result["readings"], result["truth"]
    assert len(readings) == len(truth)
    for reading, real in zip(readings, truth):
        assert reading["skipped_steps"] == real["skipped_steps"]
        assert reading["skipped"] == (not real["applied"])
        assert reading["global_step"] == real["global_steps"]
        assert reading["loss_scale"] == real["loss_scale"]
        if real["grad_norm"] is None or not math.isfinite(real["grad_norm"]):
            assert reading["grad_norm"] == real["grad_norm"]
        else:
            assert reading["grad_norm"] == pytest.approx(real["grad_norm"])


def test_bf16_zero2_a_rank_non_finite_loss_is_the_skipped_step_the_engine_counted(tmp_path, monkeypatch):
    ranks = _launch("bf16", "warn", tmp_path, monkeypatch)
    for result in ranks:
        assert result["reader"] == "DeepSpeedEngineReader" and not result["watch_failed"] and not result["warned"]
        assert _skipped_by_engine(result["truth"]) == [BAD_STEP]  # the engine skipped the planted step only
        assert math.isinf(result["truth"][BAD_STEP]["grad_norm"])
        _readings_match_engine(result)
        assert result["weights_finite"] and result["restored"]
        for wrapped, name, original, expected in result["signatures"].values():  # what user code sees: unchanged
            assert (wrapped, name) == (original, expected)
        (event,) = result["events"]  # one event, for the one step the engine skipped, on each rank
        assert event["evidence"]["source"] == "deepspeed-engine"
        assert event["evidence"]["global_step"] == result["truth"][BAD_STEP]["global_steps"]
        assert event["evidence"]["skipped"] is True
    rank0, rank1 = (r["events"][0] for r in ranks)
    assert rank1["kind"] == "nonfinite-loss" and rank1["rank"] == 1  # its own loss: it names itself
    assert rank0["kind"] == "nonfinite-grad" and rank0["rank"] is None  # its loss was finite: another rank's
    assert rank0["evidence"]["own_loss_finite"] and not rank1["evidence"]["own_loss_finite"]


def test_bf16_zero2_stop_policy_stops_every_rank_at_the_skipped_step(tmp_path, monkeypatch):
    ranks = _launch("bf16", "stop", tmp_path, monkeypatch)
    for result in ranks:
        assert result["stopped"] is not None, result["events"]
        assert result["stopped"]["at_engine_step"] == BAD_STEP + 1  # right after the engine's skipped step
        assert _skipped_by_engine(result["truth"]) == [BAD_STEP]
        assert result["weights_finite"]


def test_fp16_zero1_a_streak_of_loss_scaler_skips_is_one_skipped_steps_event(tmp_path, monkeypatch):
    ranks = _launch("fp16", "warn", tmp_path, monkeypatch)
    for result in ranks:
        truth = result["truth"]
        planted = list(range(BAD_STEP, BAD_STEP + STREAK))
        assert _skipped_by_engine(truth) == planted
        scales = [t["loss_scale"] for t in truth]
        assert scales[BAD_STEP + STREAK - 1] == scales[BAD_STEP - 1] / 2 ** STREAK  # halved at each skip
        _readings_match_engine(result)
        (event,) = result["events"]  # single skips are the scaler calibrating: the streak is the event
        assert event["kind"] == "skipped-steps" and event["evidence"]["source"] == "deepspeed-engine"
        assert event["evidence"]["consecutive_skipped"] == STREAK
        assert event["evidence"]["loss_scale"] == scales[BAD_STEP + STREAK - 1]
    # the log-line fallback's parser reads DeepSpeed's real overflow lines (rank 0 logs them)
    parsed = [p for p in map(parse_overflow, ranks[0]["deepspeed_lines"]) if p is not None]
    assert len(parsed) == STREAK, ranks[0]["deepspeed_lines"]
    assert [p["next"] for p in parsed] == [t["loss_scale"] for t in ranks[0]["truth"][BAD_STEP:BAD_STEP + STREAK]]
