"""FSDP2 (fully_shard) on two CPU ranks over gloo, through torchrun.

The sentinel sees each rank's shard of the already reduced gradient: the step's one collective sums
the shards' squares, so every rank's per-group norms are those of the whole gradient (checked
against ``full_tensor()``), named in the user's module names. A non-finite loss still names its
rank; non-finite gradients cannot (the reduction mixed them before the watch could look), and the
event says so instead of guessing. Replay localisation is not run under FSDP (it would need every
rank to replay in lockstep through FSDP's all-gathers).
"""
import math

import pytest
from ddp_helpers import BAD_STEP, STEPS, launch_torchrun, read_ranks

pytestmark = pytest.mark.multirank  # launches ranks: run by make test-loaded, with both cores busy


def _run(scenario: str, tmp_path):
    done = launch_torchrun(scenario, "skip", tmp_path, fsdp=True)
    assert done.returncode == 0, done.stdout[-4000:]
    ranks = read_ranks(tmp_path)
    assert all(r["sharded"] and r["steps"] == STEPS and r["watch_steps"] == STEPS for r in ranks)
    return ranks


def test_fsdp_group_norms_are_the_whole_gradients_in_the_users_names(tmp_path):
    ranks = _run("healthy", tmp_path)
    for r in ranks:
        assert r["events"] == []
        assert "model.layers.1.self_attn" in r["groups"] and "lm_head" in r["groups"]
        assert not any("fsdp" in g.lower() or g.startswith("module.") for g in r["groups"])
        for step, reference in enumerate(r["reference_norms"]):
            for group, value in reference.items():
                assert r["watch_norms"][group][step] == pytest.approx(value, rel=1e-5), (group, step)
    # the shards differ per rank, the norms do not: they are reduced across ranks
    assert ranks[0]["watch_norms"] == ranks[1]["watch_norms"]


def test_fsdp_nan_loss_on_rank_1_names_rank_1_and_skip_keeps_weights_finite(tmp_path):
    ranks = _run("loss", tmp_path)
    events = [[e for e in r["events"] if e["kind"] == "nonfinite-loss"] for r in ranks]
    assert all(len(e) == 1 for e in events)
    for (event,) in events:
        assert event["rank"] == 1 and event["step"] == BAD_STEP and event["cause"] == "no-supervised-tokens"
        assert event["evidence"]["loss_bad_ranks"] == [1]
    assert all(r["weights_finite"] for r in ranks) and ranks[0]["weights_sum"] == ranks[1]["weights_sum"]


def test_fsdp_backward_nan_is_caught_and_skipped_but_its_rank_is_not_claimed(tmp_path):
    ranks = _run("backward", tmp_path)
    for r in ranks:
        (event,) = [e for e in r["events"] if e["kind"] == "nonfinite-grad"]
        assert event["rank"] is None and event["evidence"]["bad_ranks"] == [0, 1]
        assert "cannot be told" in event["evidence"]["note"]
        assert "model.layers.1.mlp" in event["evidence"]["nonfinite_groups"]
        assert "lm_head" not in event["evidence"]["nonfinite_groups"]  # after the poisoned module in forward
        assert all(math.isnan(v) for v in r["watch_norms"]["model.layers.1.mlp"])
        assert r["weights_finite"]  # skip on both ranks, every step
    assert ranks[0]["weights_sum"] == ranks[1]["weights_sum"]
