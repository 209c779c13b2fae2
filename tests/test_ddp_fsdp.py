"""FSDP2 (fully_shard) on two CPU ranks over gloo, through torchrun.

The sentinel sees each rank's shard of the already reduced gradient: the step's one collective sums
the shards' squares, so every rank's per-group norms are those of the whole gradient (checked
against ``full_tensor()``), named in the user's module names. Each rank's own gradient is read
before the reduce-scatter, on FSDP's unsharded parameters (``nbguard.watcher.distributed.fsdp_grads``): a
non-finite loss or gradient names its rank. Replay localisation is not run under FSDP (it would need
every rank to replay in lockstep through FSDP's all-gathers); the bad rank's own read names the
parameters around the origin instead. Where FSDP's internals are absent, the watch reads the reduced
shards as before: the bad step is caught, and the event says why its rank cannot be told.

The scenarios run in this pytest run's shared torchrun launch (ddp_helpers.TORCHRUN_BATCH), each in its own
folder, checked clean before it starts.
"""
import math

import pytest
from ddp_helpers import BAD_STEP, STEPS, batch_ranks

pytestmark = pytest.mark.multirank  # launches ranks: run by make test-loaded, with both cores busy


def _run(scenario: str, tmp_path_factory):
    ranks = batch_ranks(tmp_path_factory, "torchrun", scenario, "skip", fn="train_fsdp_rank")
    assert all(r["sharded"] and r["steps"] == STEPS and r["watch_steps"] == STEPS for r in ranks)
    read_first = scenario != "backward-unread"
    assert all(r["pre_reduce"]["available"] == read_first and bool(r["warned"]) != read_first for r in ranks)
    return ranks


def test_fsdp_group_norms_are_the_whole_gradients_in_the_users_names(tmp_path_factory):
    ranks = _run("healthy", tmp_path_factory)
    for r in ranks:
        assert r["events"] == []
        assert "model.layers.1.self_attn" in r["groups"] and "lm_head" in r["groups"]
        assert not any("fsdp" in g.lower() or g.startswith("module.") for g in r["groups"])
        for step, reference in enumerate(r["reference_norms"]):
            for group, value in reference.items():
                assert r["watch_norms"][group][step] == pytest.approx(value, rel=1e-5), (group, step)
    # the shards differ per rank, the norms do not: they are reduced across ranks
    assert ranks[0]["watch_norms"] == ranks[1]["watch_norms"]


def test_fsdp_nan_loss_on_rank_1_names_rank_1_and_skip_keeps_weights_finite(tmp_path_factory):
    ranks = _run("loss", tmp_path_factory)
    events = [[e for e in r["events"] if e["kind"] == "nonfinite-loss"] for r in ranks]
    assert all(len(e) == 1 for e in events)
    for (event,) in events:
        assert event["rank"] == 1 and event["step"] == BAD_STEP and event["cause"] == "no-supervised-tokens"
        assert event["evidence"]["loss_bad_ranks"] == [1]
    assert all(r["weights_finite"] for r in ranks) and ranks[0]["weights_sum"] == ranks[1]["weights_sum"]


def test_fsdp_backward_nan_on_rank_1_names_rank_1_before_the_reduce_scatter(tmp_path_factory):
    ranks = _run("backward", tmp_path_factory)
    assert all(r["losses_finite"] == [True] * STEPS for r in ranks)  # only rank 1's backward makes NaN
    for r in ranks:
        (event,) = [e for e in r["events"] if e["kind"] == "nonfinite-grad"]
        assert event["rank"] == 1 and event["step"] == 0 and event["message"].startswith("rank 1: ")
        evidence = event["evidence"]
        assert evidence["bad_ranks"] == evidence["grads_bad_ranks"] == [1] and evidence["loss_bad_ranks"] == []
        assert "note" not in evidence
        # the agreed (reduced) groups: the NaN reached every rank's shard of them
        assert "model.layers.1.mlp" in evidence["nonfinite_groups"]
        assert "lm_head" not in evidence["nonfinite_groups"]  # after the poisoned module in forward
        # The module: no replay under FSDP (one rank replaying alone would wait in FSDP's all-gathers;
        # the event has no origins), so rank 1's own read, in backward order, brackets it instead. The
        # NaN is made by act_fn (down_proj(act_fn(gate_proj(x)) * up_proj(x))): gate_proj's gradient is
        # the first non-finite one; down_proj's and up_proj's (whichever autograd ran last) stay finite
        assert event["origins"] == []
        own = evidence["own_gradient"]
        assert own["read"] == "before FSDP's reduce-scatter"
        assert own["first_nonfinite_parameter"] == "model.layers.1.mlp.gate_proj.weight"
        assert own["last_finite_parameter_before"] in ("model.layers.1.mlp.up_proj.weight",
                                                       "model.layers.1.mlp.down_proj.weight")
        assert own["nonfinite_groups"][0] == "model.layers.1.mlp" and "lm_head" not in own["nonfinite_groups"]
        assert all(math.isnan(v) for v in r["watch_norms"]["model.layers.1.mlp"])  # the whole gradient's norm
        assert r["weights_finite"]  # skip on both ranks, every step
    assert ranks[0]["weights_sum"] == ranks[1]["weights_sum"]


def test_fsdp_without_the_internals_it_reads_the_backward_nan_is_caught_but_its_rank_is_not_claimed(tmp_path_factory):
    ranks = _run("backward-unread", tmp_path_factory)
    for r in ranks:
        assert "after the reduce-scatter" in r["warned"][0] and "_fsdp_param_groups" in r["warned"][0]
        (event,) = [e for e in r["events"] if e["kind"] == "nonfinite-grad"]
        assert event["rank"] is None and event["evidence"]["bad_ranks"] == [0, 1]
        note = event["evidence"]["note"]
        assert "cannot be told" in note and "could not be read first" in note and "_fsdp_param_groups" in note
        assert "own_gradient" not in event["evidence"]
        assert "model.layers.1.mlp" in event["evidence"]["nonfinite_groups"]
        assert r["weights_finite"]
    assert ranks[0]["weights_sum"] == ranks[1]["weights_sum"]
