"""The watch inside two-rank DDP runs (gloo, CPU), through notebook_launcher and torchrun.

Faults are planted on rank 1 only; every rank must report the same event naming rank 1 and the
module, apply the same policy, and finish: each run is killed as a process group on a timeout and
a hang fails the test (see ddp_helpers). The scenarios run several per launch, one launch per launcher
for the whole pytest run (ddp_helpers.NOTEBOOK_BATCH / TORCHRUN_BATCH, each scenario in its own folder,
checked clean before it starts); ``uncaught`` kills its ranks, so it has a launch of its own.
"""
import json

import pytest
from ddp_helpers import BAD_STEP, STEPS, batch_ranks, expected_kind, launch_notebook

pytestmark = pytest.mark.multirank  # launches ranks: run by make test-loaded, with both cores busy

LAUNCHERS = ("notebook_launcher", "torchrun")


def _run(launcher: str, scenario: str, policy: str, tmp_path_factory):
    """The scenario's ranks, from its launcher's shared launch (the launch's failure, or the scenario's own
    traceback, if it did not finish)."""
    ranks = batch_ranks(tmp_path_factory, launcher, scenario, policy)
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["world_size"] == 2 for r in ranks)
    assert all(r["distributed_type"] == "DistributedType.MULTI_CPU" for r in ranks)
    return ranks


def _bad_events(rank: dict) -> list[dict]:
    return [e for e in rank["events"] if e["kind"] in ("nonfinite-loss", "nonfinite-grad")]


def _same_event_on_every_rank(ranks: list[dict]) -> dict:
    firsts = []
    for r in ranks:
        assert [e for e in r["events"] if e["kind"] == "watch-error"] == [], r["events"]
        bad = _bad_events(r)
        assert len(bad) == 1, r["events"]
        assert bad[0]["evidence"]["reported_by_rank"] == r["rank"]
        firsts.append({k: v for k, v in bad[0].items() if k != "evidence"})
    assert firsts[0] == firsts[1]  # kind, step, message, cause, origins, rank: identical
    event = _bad_events(ranks[0])[0]
    assert event["rank"] == 1 and event["evidence"]["bad_ranks"] == [1]
    assert event["message"].startswith("rank 1: ")
    assert event["kind"] == expected_kind(ranks[1]["losses_finite"][event["step"]])  # the origin rank's own loss
    return event


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_healthy_run_no_event_on_any_rank_and_one_exchange_per_step(launcher, tmp_path_factory):
    ranks = _run(launcher, "healthy", "warn", tmp_path_factory)
    for r in ranks:
        assert r["events"] == [] and r["steps"] == STEPS and r["watch_steps"] == STEPS
        assert r["exchanges"] == STEPS  # one small collective per optimizer step, no more
        assert not r["streamed"]  # no %%nanwatch cell opened a stream: the ranks send nothing
        assert r["weights_finite"]
    assert ranks[0]["weights_sum"] == ranks[1]["weights_sum"]


def test_each_rank_reads_its_own_gradient_from_ddp_buckets_and_training_is_unchanged(tmp_path_factory):
    """DDP's communication hook hands the watch each bucket before the all-reduce: no hook per
    parameter, each rank's norms are its own gradient's (a local copy's, not the averaged one), and the
    weights end bit-identical to a run without the watch."""
    import math

    watched = _run("notebook_launcher", "healthy", "warn", tmp_path_factory)
    plain = _run("notebook_launcher", "unwatched", "warn", tmp_path_factory)
    for r in watched:
        assert r["gradient_read"] == {"buckets": True, "parameter_hooks": 0}
        assert r["watch_step0_norms"].keys() == r["own_step0_norms"].keys()
        for group, own in r["own_step0_norms"].items():
            assert math.isclose(r["watch_step0_norms"][group], own, rel_tol=1e-5), group
    # the ranks' batches differ, so their own gradients do (the averaged one is the same on both)
    assert watched[0]["watch_step0_norms"] != watched[1]["watch_step0_norms"]
    assert [r["weights_sum"] for r in watched] == [r["weights_sum"] for r in plain]
    assert [r["weights_abs_sum"] for r in watched] == [r["weights_abs_sum"] for r in plain]


def test_buckets_reduced_at_every_micro_batch_read_as_the_per_parameter_hooks_do(tmp_path_factory):
    """A loop that accumulates without no_sync: DDP reduces each micro-batch, so each bucket holds the
    gradient accumulated so far. The step's norms are the last bucket's, as the per-parameter hooks (a run
    whose DDP already has another communication hook) read them: no bucket counted twice."""
    import math

    buckets = _run("notebook_launcher", "accumulate", "warn", tmp_path_factory)
    hooks = _run("notebook_launcher", "accumulate-hooks", "warn", tmp_path_factory)
    for b, h in zip(buckets, hooks):
        assert b["gradient_read"]["buckets"] and not h["gradient_read"]["buckets"] and h["gradient_read"]["parameter_hooks"]
        assert b["watch_steps"] == h["watch_steps"] == STEPS // 2 and b["events"] == h["events"] == []
        assert b["history_norms"].keys() == h["history_norms"].keys()
        for group, norms in b["history_norms"].items():
            assert all(math.isclose(x, y, rel_tol=1e-5) for x, y in zip(norms, h["history_norms"][group], strict=True)), group


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_forward_overflow_on_rank_1_named_on_every_rank_and_skipped_everywhere(launcher, tmp_path_factory):
    ranks = _run(launcher, "forward", "skip", tmp_path_factory)
    event = _same_event_on_every_rank(ranks)
    assert event["step"] == BAD_STEP and event["cause"] == "overflow"
    origin = event["origins"][0]
    assert origin["module"] == "model.layers.0.self_attn.q_proj"  # the user's name: no "module." prefix
    assert origin["phase"] == "forward" and origin["dtype"] == "float16"
    # skip on all: the NaN-averaged update was dropped on both ranks, the weights agree and are finite
    for r in ranks:
        assert r["steps"] == STEPS and r["weights_finite"] and r["stopped"] is None
    assert ranks[0]["weights_sum"] == ranks[1]["weights_sum"]
    assert ranks[0]["weights_abs_sum"] == ranks[1]["weights_abs_sum"]


def test_without_skip_the_nan_reaches_both_ranks_weights(tmp_path_factory):
    """The policy is what keeps the weights finite: under warn rank 1's overflow is averaged into both."""
    ranks = _run("notebook_launcher", "forward", "warn", tmp_path_factory)
    _same_event_on_every_rank(ranks)
    assert not ranks[0]["weights_finite"] and not ranks[1]["weights_finite"]


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_backward_nan_on_rank_1_names_the_module_on_every_rank(launcher, tmp_path_factory):
    ranks = _run(launcher, "backward", "skip", tmp_path_factory)
    event = _same_event_on_every_rank(ranks)
    assert event["kind"] == "nonfinite-grad" and event["cause"] == "invalid-op"
    origin = event["origins"][0]
    assert origin["module"] == "model.layers.1.mlp.act_fn" and origin["phase"] == "backward"
    assert event["evidence"]["grads_bad_ranks"] == [1] and event["evidence"]["loss_bad_ranks"] == []
    assert all(r["weights_finite"] for r in ranks)
    assert ranks[0]["weights_sum"] == ranks[1]["weights_sum"]


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_nan_loss_on_one_rank(launcher, tmp_path_factory):
    ranks = _run(launcher, "loss", "skip", tmp_path_factory)
    event = _same_event_on_every_rank(ranks)
    assert event["kind"] == "nonfinite-loss" and event["cause"] == "no-supervised-tokens"
    assert event["step"] == BAD_STEP and event["evidence"]["loss_bad_ranks"] == [1]
    assert all(r["weights_finite"] and r["steps"] == STEPS for r in ranks)
    assert ranks[0]["weights_sum"] == ranks[1]["weights_sum"]


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_stop_stops_every_rank_at_the_same_step_and_all_exit(launcher, tmp_path_factory):
    ranks = _run(launcher, "forward", "stop", tmp_path_factory)
    _same_event_on_every_rank(ranks)
    for r in ranks:
        assert r["steps"] == BAD_STEP  # the step that went bad never finished, on either rank
        assert r["stopped"] and "rank 1" in r["stopped"] and "q_proj" in r["stopped"]
        assert r["weights_finite"]
    assert ranks[0]["weights_sum"] == ranks[1]["weights_sum"]


def test_a_rank_whose_watch_fails_does_not_block_the_other(tmp_path_factory):
    ranks = _run("notebook_launcher", "fail", "warn", tmp_path_factory)
    errors = {r["rank"]: [e for e in r["events"] if e["kind"] == "watch-error"] for r in ranks}
    assert "planted failure" in errors[1][0]["message"] and errors[1][0]["rank"] == 1
    assert "stepped aside" in errors[0][0]["message"] and errors[0][0]["evidence"]["leaving_ranks"] == [1]
    for r in ranks:
        assert r["steps"] == STEPS  # training went on to the end on both ranks
        assert r["watch_steps"] == BAD_STEP  # both watches stepped aside at the same step


@pytest.mark.parametrize("launcher,policy", [("torchrun", "skip"), ("notebook_launcher", "stop")])
def test_trainer_under_ddp_names_rank_1_and_agrees_on_the_policy(launcher, policy, tmp_path_factory):
    """The HF Trainer (its own DDP wrap, gradient accumulation 2, clipping) with the watch on it."""
    ranks = batch_ranks(tmp_path_factory, launcher, "backward", policy, fn="train_trainer_rank")
    event = _same_event_on_every_rank(ranks)
    assert event["step"] == BAD_STEP and event["origins"][0]["module"] == "model.layers.1.mlp.act_fn"
    assert event["evidence"]["micro_batches"] == 2  # rank 1 replayed both of its micro-batches
    for r in ranks:
        assert r["weights_finite"]
        assert r["gradient_read"] == {"buckets": True, "parameter_hooks": 0}  # train() wrapped it: DDP's hook
        # stop: the Trainer ends after the bad step on both ranks; skip: it runs to the end on both
        assert r["steps"] == (BAD_STEP + 1 if policy == "stop" else STEPS)
    assert ranks[0]["weights_sum"] == ranks[1]["weights_sum"]


def test_gradscaler_skip_streak_under_ddp_names_the_overflowing_rank(tmp_path_factory):
    """fp16 + GradScaler (the T4 case): the scaler skips on both ranks because the all-reduced
    gradients are inf; the streak event names rank 1 and its forward overflow, not rank 0's batch."""
    ranks = _run("notebook_launcher", "scaler", "warn", tmp_path_factory)
    events = [[e for e in r["events"] if e["kind"] == "skipped-steps"] for r in ranks]
    assert all(len(e) == 1 for e in events), [r["events"] for r in ranks]
    assert {k: v for k, v in events[0][0].items() if k != "evidence"} == \
        {k: v for k, v in events[1][0].items() if k != "evidence"}
    event = events[0][0]
    assert event["rank"] == 1 and event["evidence"]["bad_ranks"] == [1]
    assert event["step"] == BAD_STEP + 1 and event["evidence"]["consecutive_skipped"] == 2
    origin = event["origins"][0]
    assert origin["module"] == "model.layers.0.self_attn.q_proj" and origin["phase"] == "forward"
    assert all(r["weights_finite"] for r in ranks)  # the scaler skipped: nothing non-finite was applied
    assert ranks[0]["weights_sum"] == ranks[1]["weights_sum"]


def test_a_watch_on_rank_0_alone_watches_that_rank_and_never_waits_for_rank_1(tmp_path_factory):
    ranks = _run("notebook_launcher", "rank0only", "warn", tmp_path_factory)
    assert [r["watched"] for r in ranks] == [True, False]
    assert ranks[0]["exchanges"] == 0 and ranks[0]["watch_steps"] == STEPS  # local watch, every step seen
    assert len(ranks[0]["warned"]) == 1 and "not on every rank" in ranks[0]["warned"][0]
    assert all(r["steps"] == STEPS and r["events"] == [] for r in ranks)
    assert ranks[0]["weights_sum"] == ranks[1]["weights_sum"]


def test_stop_left_uncaught_fails_every_rank_promptly_instead_of_hanging(tmp_path):
    """Both ranks raise NonFiniteError at the same step, so neither waits in a collective for the
    other: the launcher reports the failure (the kernel gets ChildFailedError), nothing hangs."""
    done = launch_notebook("uncaught", "stop", tmp_path)
    assert done.returncode != 0
    assert "ChildFailedError" in done.stdout and "NonFiniteError" in done.stdout
    # the kind follows rank 1's own loss at the bad step (written just before it raised); module and rank are fixed
    rank1_losses_finite = json.loads((tmp_path / "losses1.json").read_text())
    what = {"nonfinite-loss": "non-finite loss", "nonfinite-grad": "non-finite gradient"}[
        expected_kind(rank1_losses_finite[BAD_STEP])]
    assert f"rank 1: {what}: overflow in model.layers.0.self_attn.q_proj" in done.stdout
    assert not list(tmp_path.glob("rank*.json"))  # neither rank got past the raise
