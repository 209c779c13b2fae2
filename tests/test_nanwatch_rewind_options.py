"""%%nanwatch's rewind options (--every, --lr-factor, --max-rewinds, --schedule, --scheduler) reach the watch it
starts, on a real plain loop in a real IPython shell; bad values are named by the flag the user typed."""
from __future__ import annotations

import pytest
import torch
from notebook_helpers import run, shell  # noqa: F401  (the fixture)

from nbguard.notebook import magics
from nbguard.watcher.policy import policies, rewind

SETUP = ("import torch\nfrom nbguard.testing import tiny_llama, tiny_batch\nnet = tiny_llama()\n"
         "opt = torch.optim.AdamW(net.parameters(), lr=1e-3)\n"
         "sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 300.0 if s in (4, 5) else 1.0)\n"
         "batch = tiny_batch()\n"
         "%config NbguardMagics.verify_fixes = False\n")
# a schedule that puts the LR at 0.3 for two steps: the loss climbs 4 -> 17, a divergence that rewinds and
# cuts the LR
LOOP = "for i in range(12):\n    opt.zero_grad()\n    net(**batch).loss.backward()\n    opt.step()\n    sched.step()\n"


def test_the_magic_keeps_the_watchers_names():
    assert magics.POLICIES == policies.POLICIES and magics.SCHEDULES == rewind.SCHEDULES


def test_every_and_lr_factor_reach_the_watch(shell):  # noqa: F811
    assert run(shell, SETUP).error is None
    # the line magic: the watch stays on until %nanwatch off, so its settings can be read
    assert run(shell, "%nanwatch net --policy rewind --every 2 --lr-factor 0.25 --max-rewinds 5 --scheduler sched")\
        .error is None
    watch = magics_state(shell).watches[-1].watch
    cell = run(shell, LOOP)
    assert cell.error is None, cell.stdout
    run(shell, "%nanwatch off")
    settings = watch._rewinder.settings
    assert (settings.every, settings.lr_factor, settings.max_rewinds) == (2, 0.25, 5)
    rewinds = [e for e in watch.events if e.kind == "rewind"]
    assert rewinds and rewinds[0].evidence["lr_factor"] == 0.25
    # snapshots every 2 steps: the state after step 2, the last before the climb (every 50: only step 0's)
    assert rewinds[0].evidence["restored_after_step"] == 2
    # the LR cut reached the scheduler the option named (its base LR, which it sets the LR from each step)
    assert shell.user_ns["sched"].base_lrs[0] == pytest.approx(1e-3 * 0.25)
    assert all(torch.isfinite(p).all() for p in shell.user_ns["net"].parameters())
    # the cell magic takes the same options, and its summary shows the cut
    assert run(shell, SETUP).error is None
    cell = run(shell, "%%nanwatch net --policy rewind --every 2 --lr-factor 0.25 --scheduler sched\n" + LOOP)
    assert "lr x0.25" in cell.updates[-1]["text/plain"], cell.updates[-1]["text/plain"]  # the view shows the cut


def test_rewind_options_under_another_policy_are_refused(shell):  # noqa: F811
    assert run(shell, SETUP).error is None
    cell = run(shell, "%%nanwatch net --policy skip --every 5\npass\n")
    assert "--every set(s) how policy rewind works, and the policy here is skip" in cell.stdout + cell.stderr


def test_a_bad_value_is_named_by_its_flag(shell):  # noqa: F811
    assert run(shell, SETUP).error is None
    cell = run(shell, "%%nanwatch net --policy rewind --lr-factor 2\npass\n")
    assert "--lr-factor must be in (0, 1], got 2.0" in cell.stdout + cell.stderr
    cell = run(shell, "%%nanwatch net --policy rewind --scheduler batch\npass\n")
    assert "--scheduler 'batch' is a" in cell.stdout + cell.stderr and "not an LR scheduler" in cell.stdout + cell.stderr


def magics_state(shell):  # noqa: F811
    """The loaded NbguardMagics' state (its watches)."""
    return shell.magics_manager.registry["NbguardMagics"].state
