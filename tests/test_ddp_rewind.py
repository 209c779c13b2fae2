"""policy="rewind" across two DDP ranks (gloo, CPU, notebook_launcher): every rank rewinds alike. The run is a
scenario of this pytest run's shared notebook_launcher launch (ddp_helpers.NOTEBOOK_BATCH)."""
import math

import pytest
from ddp_helpers import REWIND_STEPS, SPIKE_STEPS, batch_ranks

pytestmark = pytest.mark.multirank


@pytest.mark.parametrize("scenario", ["rewind", "rewind+deferred"])
def test_two_ranks_rewind_together_and_end_with_identical_finite_weights(scenario, tmp_path_factory):
    """An LR blow-up on both ranks: the update at the spike's first step makes the weights huge, the next
    steps' gradients non-finite on both ranks (skipped: the weights are still finite; the second bad step
    in a row rewinds). Both rewind at the same step to the same snapshot (taken before the
    spike), the run goes on, and the ranks end with the same finite weights and finite losses. So too read a
    step late (``read="deferred"``, fused AdamW), where each step is judged at the next one's check."""
    ranks = batch_ranks(tmp_path_factory, "notebook_launcher", scenario, "rewind", fn="train_rewind_rank")
    first_spike = SPIKE_STEPS[0]
    rewinds = []
    for r in ranks:
        assert r["policy"] == "rewind", r["events"]  # rewinding was not turned off across ranks
        assert r["read_late"] == scenario.endswith("+deferred")
        assert [e for e in r["events"] if e["kind"] == "watch-error"] == [], r["events"]
        restored = [e for e in r["events"] if e["kind"] == "rewind" and e["evidence"].get("restored")]
        assert restored, r["events"]
        rewinds.append([(e["step"], e["evidence"]["restored_after_step"], e["evidence"]["batches_skipped"])
                        for e in restored])
        # the damage was real: the step after the spike's update had non-finite gradients on every rank
        bad = [e for e in r["events"] if e["kind"] in ("nonfinite-loss", "nonfinite-grad")]
        assert bad and bad[0]["step"] == first_spike + 1, r["events"]
        # no event of a step whose weights the rewind replaced (read late: the step under way when it came)
        assert all(e["step"] < restored[0]["step"] for e in bad), r["events"]
        assert all(math.isfinite(loss) for loss in r["losses"][-4:])  # and the run came back from it
        assert r["weights_finite"]
    assert rewinds[0] == rewinds[1]  # the same steps, the same snapshot, on both ranks
    step, after, skipped = rewinds[0][0]
    assert after < first_spike  # the state from before the update at the spike's LR
    assert skipped == step - after
    assert ranks[0]["weights_sum"] == ranks[1]["weights_sum"]
    assert ranks[0]["weights_abs_sum"] == ranks[1]["weights_abs_sum"]
    assert [e["step"] for e in ranks[0]["rewinds"]] == [e["step"] for e in ranks[1]["rewinds"]]
    assert len(ranks[0]["losses"]) == REWIND_STEPS
