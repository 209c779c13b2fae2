"""Issue 45 across ranks: ``read="deferred"`` under two-rank DDP (gloo, CPU), each scenario beside its twin.

The step's exchange (one ``all_reduce``) is a collective on the device, not a host read: its summed flags
decide the fused AdamW's device skip on every rank alike, and the ranks read it a step late at the same
point. A healthy step makes no host read of nbguard's; a bad update on rank 1 is dropped on both ranks at
its own step, and named as the host mode names it; a rank whose watch fails is known to its peer before
the peer joins another exchange (a hang fails the launch: see ddp_helpers).
"""
import pytest
from ddp_helpers import BAD_STEP, STEPS, batch_ranks

pytestmark = pytest.mark.multirank  # launches ranks: run by make test-loaded, with both cores busy


def _ranks(scenario: str, policy: str, tmp_path_factory) -> list[dict]:
    ranks = batch_ranks(tmp_path_factory, "notebook_launcher", scenario, policy)
    assert [r["rank"] for r in ranks] == [0, 1]
    return ranks


def _weights(ranks: list[dict]) -> list[tuple[float, float]]:
    return [(r["weights_sum"], r["weights_abs_sum"]) for r in ranks]


def _event(rank: dict) -> dict:
    bad = [e for e in rank["events"] if e["kind"] in ("nonfinite-loss", "nonfinite-grad")]
    assert len(bad) == 1, rank["events"]
    return {k: v for k, v in bad[0].items() if k != "evidence"}


def test_a_healthy_step_reads_nothing_on_the_host_and_training_is_bit_identical(tmp_path_factory):
    watched = _ranks("healthy+deferred", "skip", tmp_path_factory)
    host = _ranks("healthy+fused", "skip", tmp_path_factory)
    plain = _ranks("unwatched+fused", "skip", tmp_path_factory)
    for r in watched:
        assert r["read_late"] and r["warned"] == []  # deferred across ranks, not the host fallback
        assert r["events"] == [] and r["skipped"] == [] and r["watch_steps"] == STEPS
        assert r["exchanges"] == STEPS  # one collective per step, as in the host mode
        assert r["host_reads"] == {}  # no host read of nbguard's own code on any step
        assert r["host_reads_landed"] == STEPS - 1  # each step's mirror, read at the next (the last at detach)
        assert r["gradient_read"] == {"buckets": True, "parameter_hooks": 0}
    assert _weights(watched) == _weights(plain) == _weights(host)
    assert watched[0]["weights_sum"] == watched[1]["weights_sum"]
    # judged a step late, every step's numbers are the host mode's
    assert [r["history_norms"] for r in watched] == [r["history_norms"] for r in host]


def test_a_nan_on_rank_1_is_dropped_on_both_ranks_and_named_as_the_host_mode_names_it(
        tmp_path_factory):
    late = _ranks("backward+deferred", "skip", tmp_path_factory)
    host = _ranks("backward+fused", "skip", tmp_path_factory)
    events = [_event(r) for r in late]
    assert events[0] == events[1] == _event(host[0])  # kind, step, message, cause, origins, rank
    assert events[0]["rank"] == 1 and events[0]["origins"][0]["module"] == "model.layers.1.mlp.act_fn"
    assert host[0]["skipped"] == list(range(STEPS))  # (rank 1's SiLU is poisoned at every step)
    for r in late:
        assert r["read_late"] and r["skipped"] == host[0]["skipped"] and r["steps"] == STEPS and r["weights_finite"]
    # the device skip dropped the same update the host mode dropped: the weights are the host mode's, bit for bit
    assert _weights(late) == _weights(host)


def test_a_bad_loss_on_rank_1_at_one_step_drops_that_update_on_both_ranks_as_the_host_mode_does(tmp_path_factory):
    late = _ranks("loss+deferred", "skip", tmp_path_factory)
    host = _ranks("loss+fused", "skip", tmp_path_factory)
    events = [_event(r) for r in late]
    assert events[0] == events[1] == _event(host[0])
    assert events[0]["step"] == BAD_STEP and events[0]["rank"] == 1 and events[0]["cause"] == "no-supervised-tokens"
    for r in late + host:
        assert r["skipped"] == [BAD_STEP] and r["steps"] == STEPS and r["weights_finite"]
    assert _weights(late) == _weights(host)  # the same update dropped, every other applied: bit for bit


def test_stop_a_step_late_stops_every_rank_at_the_same_step_with_the_weights_of_before_it(tmp_path_factory):
    ranks = _ranks("loss+deferred", "stop", tmp_path_factory)
    assert _event(ranks[0]) == _event(ranks[1])
    assert _event(ranks[0])["kind"] == "nonfinite-loss" and _event(ranks[0])["rank"] == 1
    for r in ranks:
        assert r["read_late"]
        assert r["steps"] == BAD_STEP + 1  # judged at the next step's check: the loop stopped inside that step
        assert r["stopped"] and "rank 1" in r["stopped"] and f"step {BAD_STEP}" in r["stopped"]
        assert r["weights_finite"]
    assert ranks[0]["weights_sum"] == ranks[1]["weights_sum"]


def test_a_rank_whose_watch_fails_is_known_to_the_other_before_its_next_exchange(tmp_path_factory):
    """Rank 1's watch fails before its part of step BAD_STEP's exchange and joins it once, flagged as leaving;
    rank 0 reads that a step late, before it would join another exchange alone (a hang fails the launch)."""
    ranks = _ranks("fail+deferred", "warn", tmp_path_factory)
    errors = {r["rank"]: [e for e in r["events"] if e["kind"] == "watch-error"] for r in ranks}
    assert "planted failure" in errors[1][0]["message"] and errors[1][0]["rank"] == 1
    assert "stepped aside" in errors[0][0]["message"] and errors[0][0]["evidence"]["leaving_ranks"] == [1]
    for r in ranks:
        assert r["read_late"]
        assert r["steps"] == STEPS  # training went on to the end on both ranks
        assert r["watch_steps"] == BAD_STEP  # both watches stepped aside at the same step
        assert r["exchanges"] == BAD_STEP + 1  # the failing step's exchange, joined once by each, and no more


def test_the_trainer_under_ddp_read_a_step_late_names_and_skips_as_its_host_twin(tmp_path_factory):
    """The HF Trainer (its own DDP wrap, gradient accumulation 2, clipping, its default fused AdamW): rank 1's
    backward NaN from BAD_STEP on is named on both ranks, with both micro-batches replayed, and the same updates
    are dropped on the device as the host mode drops them, bit for bit."""
    late = batch_ranks(tmp_path_factory, "notebook_launcher", "backward+deferred", "skip", fn="train_trainer_rank")
    host = batch_ranks(tmp_path_factory, "notebook_launcher", "backward+fused", "skip", fn="train_trainer_rank")
    assert [r["read_late"] for r in late + host] == [True, True, False, False]
    events = [_event(r) for r in late]
    assert events[0] == events[1] == _event(host[0])
    assert events[0]["step"] == BAD_STEP and events[0]["origins"][0]["module"] == "model.layers.1.mlp.act_fn"
    for r in late + host:
        assert r["skipped"] == list(range(BAD_STEP, STEPS)) and r["steps"] == STEPS and r["weights_finite"]
        assert r["gradient_read"] == {"buckets": True, "parameter_hooks": 0}
    assert _weights(late) == _weights(host)


def test_ddp_under_a_communication_hook_of_the_users_reads_on_the_host_and_says_why(tmp_path_factory):
    """DDP takes one communication hook: with the user's own, the watch reads each rank's gradient with a hook per
    parameter, and that read is not deferred. It says so once, on each rank, and watches on the host."""
    ranks = _ranks("accumulate-hooks+deferred", "skip", tmp_path_factory)
    for r in ranks:
        assert not r["read_late"] and r["gradient_read"]["buckets"] is False
        assert len(r["warned"]) == 1 and "hook per parameter" in r["warned"][0], r["warned"]
        assert r["events"] == [] and r["steps"] == STEPS and r["watch_steps"] == STEPS // 2  # (2 micro-batches a step)
        assert r["exchanges"] == STEPS // 2
    assert ranks[0]["weights_sum"] == ranks[1]["weights_sum"]
