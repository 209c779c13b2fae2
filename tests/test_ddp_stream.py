"""Forked ranks stream their watch to the kernel process: one view with a row per rank, one report."""
import json
import multiprocessing
import os

import pytest
from ddp_helpers import BAD_STEP, STEPS, expected_kind, launch_streamed, read_ranks
from notebook_helpers import run, shell  # noqa: F401 - the fixture

from nbguard.document.merge import gather
from nbguard.watcher.distributed import stream


def _child_sends() -> None:
    channel = stream.inherited_channel()
    channel.send({"from_child": channel is not None})


def test_only_a_forked_child_finds_the_kernels_channel():
    received = []
    channel = stream.RankChannel(received.append).open()
    try:
        assert stream.inherited_channel() is None  # the kernel process itself never streams to itself
        child = multiprocessing.get_context("fork").Process(target=_child_sends)
        child.start()
        child.join(30)
        assert child.exitcode == 0
    finally:
        channel.close()
    assert received == [{"from_child": True}] and channel.errors == []
    assert stream.inherited_channel() is None and stream._CHANNEL is None  # closed: nothing left behind


def test_a_channel_needs_a_callable():
    import pytest

    with pytest.raises(TypeError, match="on_message must be callable"):
        stream.RankChannel(on_message=None)


@pytest.mark.multirank  # launches ranks: run by make test-loaded, with both cores busy
def test_forked_ranks_stream_steps_and_events_into_one_view_and_one_report(tmp_path):
    done = launch_streamed("forward", "skip", tmp_path)
    assert done.returncode == 0, done.stdout[-4000:]
    ranks = read_ranks(tmp_path)
    assert all(r["streamed"] for r in ranks)
    parent = json.loads((tmp_path / "parent.json").read_text())
    assert parent["stream_errors"] == []
    # the live view's rows: one per rank, each at the last step, each with the one event
    rows = parent["rows"]
    assert [r["rank"] for r in rows] == [0, 1]
    assert all(r["step"] == STEPS - 1 and r["skipped"] == 1 and r["events"] == 1 for r in rows)
    # the kind follows rank 1's own loss (the origin rank), whichever release's attention made it
    assert all(ranks[0]["losses_finite"])  # rank 0's batches are healthy
    kind = expected_kind(ranks[1]["losses_finite"][BAD_STEP])
    assert all(r["last_event"] == kind for r in rows)
    # every listener call carried its rank: steps from both ranks, the event from both ranks
    seen = [tuple(s) for s in parent["seen"]]
    assert sorted(s for s in seen if s[0] == "step") == [("step", 0)] * STEPS + [("step", 1)] * STEPS
    assert [s for s in seen if s[0] == "event"] == [("event", 1), ("event", 1)]  # both name origin rank 1
    # the kernel's copy equals what each rank recorded itself
    watches = gather(parent["document"], "watches")
    for rank, w in zip(ranks, watches):
        assert w["title"] == f"nbguard NaN/Inf watch (rank {rank['rank']} of 2)"
        assert [e["message"] for e in w["events"]] == [e["message"] for e in rank["events"]]
        assert w["history"]["steps"] == list(range(STEPS)) and w["history"]["skipped_steps"] == [BAD_STEP]
    # nbguard.report() in the kernel: every rank, the rank on every event
    report_events = [e for w in gather(parent["report"], "watches") for e in w["events"]]
    assert len(report_events) == 2 and {e["rank"] for e in report_events} == {1}
    assert report_events[0]["origins"][0]["module"] == "model.layers.0.self_attn.q_proj"


def test_nanwatch_ranks_opens_the_stream_and_off_closes_it(shell):  # noqa: F811 - the fixture
    """%nanwatch --ranks in a real InteractiveShell: the channel a forked rank would inherit is open
    while it runs, one view is shown, and %nanwatch off closes the channel."""
    cell = run(shell, "%nanwatch --ranks")
    assert cell.error is None and stream._CHANNEL is not None and stream._CHANNEL.owner_pid == os.getpid()
    assert len(cell.docs) == 1 and "across 0 ranks" in cell.docs[0]["title"]  # no rank has attached yet
    off = run(shell, "%nanwatch off")
    assert off.error is None and stream._CHANNEL is None


def test_nanwatch_cell_without_a_launcher_or_a_model_still_asks_for_a_model(shell):  # noqa: F811
    cell = run(shell, "%%nanwatch\nx = 1")
    assert "no Trainer or torch.nn.Module found" in cell.stderr  # the magic's one-line error
    assert stream._CHANNEL is None
