"""The DDP, GRPO and rewind notebooks, executed headless."""
from __future__ import annotations

import math

import pytest
from notebook_run_helpers import (  # noqa: F401  (execute: the fixture)
    MIME,
    _cells,
    _docs,
    _events,
    _no_errors,
    _not_in_tf450_lane,
    _number_after,
    _text,
    execute,
)

pytestmark = pytest.mark.notebooks


@pytest.mark.multirank  # launches ranks: run by make test-loaded, with both cores busy
def test_ddp_two_ranks(execute):
    """%%nanwatch around notebook_launcher: one dashboard with a row per rank, the event on both
    ranks naming rank 1 and the module, weights identical after skip, one report for all ranks."""
    import json

    from nbguard.document.merge import gather

    _not_in_tf450_lane()
    nb, out = execute("07_ddp_two_ranks.ipynb")
    _no_errors(nb)
    watches = gather(_docs(nb, "before-fix", "watch")[-1], "watches")
    assert [w["title"] for w in watches] == [f"nbguard NaN/Inf watch (rank {r} of 2)" for r in (0, 1)]
    for w in watches:
        (event,) = w["events"]
        assert event["rank"] == 1 and event["cause"] == "overflow" and event["step"] == 1
        assert event["origins"][0]["module"] == "model.layers.0.self_attn.q_proj"
        assert w["history"]["skipped_steps"] == [1] and w["history"]["steps"] == [0, 1, 2, 3]
    sums = {line.split(":")[0]: line.split("sum=")[1] for line in _text(nb, "before-fix", "watch").splitlines()
            if "weights finite=True" in line}
    assert set(sums) == {"rank 0", "rank 1"} and sums["rank 0"] == sums["rank 1"]
    # headless (nbclient) the saved output is the static view, no widget: both ranks' watches are in it
    shown = [o["data"]["text/html"] for c in _cells(nb, "before-fix", "watch") for o in c.get("outputs", [])
             if MIME in o.get("data", {})][-1]
    assert all(f"nbguard NaN/Inf watch (rank {r} of 2)" in shown for r in (0, 1))
    report = json.loads((out / "07_ddp_two_ranks.json").read_text())
    events = [e for w in gather(report, "watches") for e in w["events"]]
    assert len(events) == 2 and all(e["rank"] == 1 for e in events)
    assert (out / "07_ddp_two_ranks.html").is_file()


def test_grpo_broken_reward(execute):
    """Issue 20: a GRPO reward of -inf, caught by the audit and at the run's first step, fixed, trained again."""
    _not_in_tf450_lane()
    nb, out = execute("08_grpo_broken_reward.ipynb")
    _no_errors(nb)
    broken = [f for d in _docs(nb, "before-fix", "audit") for f in d["findings"]
              if f["rule"] == "rl-reward-function-broken"]
    assert [f["evidence"]["reward_function"] for f in broken] == ["match_reward"]
    (event,) = _events(_docs(nb, "before-fix", "watch"))
    assert event["kind"] == "nonfinite-reward" and event["step"] == 0
    assert event["evidence"]["reward_function"] == "match_reward"
    assert "-inf" in _text(nb, "before-fix", "watch").split("logged (reward, loss, grad_norm):")[1].split("\n")[0]
    assert _events(_docs(nb, "after-fix", "watch")) == []
    after = _text(nb, "after-fix", "watch").split("logged (reward, loss, grad_norm):")[1].split("\n")[0]
    assert "inf" not in after and "nan" not in after
    assert (out / "08_grpo_broken_reward.html").is_file()


def test_rewind_lr_blowup(execute):
    """Issue 32: an LR spike that skip cannot save, rewound to the snapshot before it (the final loss near a
    healthy run's); a poisoned row named by its dataset index, dropped by the drop-rows cell, the run clean."""
    _not_in_tf450_lane()
    nb, out = execute("09_rewind_lr_blowup.ipynb")
    _no_errors(nb)
    healthy = _number_after(_text(nb, "healthy"), "healthy final loss:")
    # skip: the divergence is caught at step 61 (the LR is 1.0 from step 60) and comes back: the run is ruined
    skip_events = _events(_docs(nb, "before-fix", "watch", "lr-spike"))
    divergences = [e for e in skip_events if e["kind"] == "divergence"]
    assert len(divergences) >= 2 and divergences[0]["step"] == 61
    assert "rewind" not in {e["kind"] for e in skip_events}
    # the update norms saw it coming: the step whose update the LR of 1.0 made (60) is an update-spike
    assert [(e["kind"], e["step"]) for e in skip_events][0] == ("update-spike", 60)
    skipped = _number_after(_text(nb, "before-fix", "loss", "lr-spike"), "final loss under skip:")
    assert skipped > 2 * healthy
    # rewind: back to the snapshot taken after step 50 (every=50, the newest before the spike), LR halved
    (rewound_doc,) = _docs(nb, "after-fix", "watch", "lr-spike")
    rewinds = [e for e in _events([rewound_doc]) if e["kind"] == "rewind"]
    assert rewinds and rewinds[0]["step"] == 61 and rewinds[0]["evidence"]["trigger"] == "divergence"
    assert all(e["evidence"]["restored"] and e["evidence"]["restored_after_step"] == 50 for e in rewinds)
    assert [r["restored_after_step"] for r in rewound_doc["history"]["rewinds"]] == [50] * len(rewinds)
    text = _text(nb, "after-fix", "loss", "lr-spike")
    assert "step 61: restored the state after step 50, 11 batches skipped" in text
    rewound = _number_after(text, "final loss under rewind:")
    assert math.isfinite(rewound) and abs(rewound - healthy) <= 0.25 * healthy
    # the poisoned row: named by dataset index 37, skipped (the weights stayed finite: nothing to undo)
    (bad,) = _events(_docs(nb, "before-fix", "watch", "rows"))
    assert bad["kind"] == "nonfinite-loss" and bad["evidence"]["rows"]["dataset_indices"] == [37]
    assert bad["evidence"]["rewind"]["restored"] is False and "dataset index 37" in bad["message"]
    assert "rows named by dataset index [37]" in _text(nb, "before-fix", "rows-named")
    fix = _text(nb, "fix", "rows")
    assert "_bad_rows = {37}" in fix and "rows left: 63" in fix  # the drop-rows cell, with the named index
    (after,) = _docs(nb, "after-fix", "watch", "rows")
    assert _events([after]) == [] and all(math.isfinite(float(x)) for x in after["history"]["loss"])
    assert (out / "09_rewind_lr_blowup.html").is_file()
