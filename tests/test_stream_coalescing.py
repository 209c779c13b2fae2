"""A forked rank's steps reach the kernel coalesced: a bounded number of messages whatever the step
rate, every step kept, in order with the events, and nothing pending lost when the rank exits."""
import multiprocessing

import torch

import nbguard
from nbguard.notebook.ranks import RankWatches
from nbguard.testing import tiny_batch, tiny_llama
from nbguard.watcher.distributed import stream

STEPS = 60


class SteppedClock:
    """The streamer's clock, moved by the loop: each step takes ``step_s`` of pretend time."""

    def __init__(self, step_s: float):
        self.now, self.step_s = 0.0, step_s

    def __call__(self) -> float:
        return self.now


def _stream_from_a_forked_rank(view: RankWatches, rank_main, *args) -> stream.RankChannel:
    """Open the kernel's channel into ``view``, fork a rank running ``rank_main(*args)``, wait for it to
    end cleanly, close the channel (what the rank sent is drawn first); the channel, for its counts."""
    channel = stream.RankChannel(view.on_message).open()
    try:
        child = multiprocessing.get_context("fork").Process(target=rank_main, args=args)
        child.start()
        child.join(300)
        assert child.exitcode == 0
    finally:
        channel.close()
    assert channel.errors == []
    return channel


def _train(watch, model, opt, steps: int, clock: SteppedClock | None = None, nan_at: int | None = None) -> None:
    batch = tiny_batch()
    for step in range(steps):
        if step == nan_at:
            with torch.no_grad():
                model.model.layers[0].mlp.down_proj.weight[0, 0] = float("nan")
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if clock is not None:
            clock.now += clock.step_s


def _fast_rank(steps: int, nan_at: int) -> None:
    """A forked rank: its watch streams through the inherited channel (as under %%nanwatch), 100 steps
    a second of pretend time, detached at the end; exit code 3 when the detach left steps pending."""
    model = tiny_llama()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    watch = nbguard.watch(model, optimizer=opt, policy="skip")
    streamer = stream.connect(watch, rank=3, world_size=4)
    clock = SteppedClock(step_s=0.01)  # 25 steps per 0.25 s interval
    streamer.clock, streamer._last_sent = clock, -1.0  # the attach message went at real time
    _train(watch, model, opt, steps, clock, nan_at=nan_at)
    watch.detach()  # sends what is pending
    raise SystemExit(3 if streamer.pending else 0)


def test_a_fast_loop_sends_a_message_per_interval_and_every_step_arrives():
    view = RankWatches(record=False)
    seen: list[tuple[str, int]] = []
    view.add_listener(lambda _w, kind, payload: seen.append((kind, payload.step if kind == "event" else payload["step"])))
    channel = _stream_from_a_forked_rank(view, _fast_rank, STEPS, 40)
    rank = view.ranks[3]
    assert rank.history.steps == list(range(STEPS)) and rank.history.skipped_steps[0] == 40
    # the NaN in the weight stays: the bad step's event, then the skip that cannot save the run
    # (a loaded machine may add a slow-steps event: the step clock reads real time, which this test does not drive)
    numeric = [(e.step, e.kind) for e in rank.events if e.kind != "slow-steps"]
    assert numeric[:1] in ([(40, "nonfinite-loss")], [(40, "nonfinite-grad")])
    # attach, the first step at once, a message per 0.25 s of steps (0.6 s of them), each event with the
    # steps before it, the rest at detach: a message per step would be 61
    assert channel.received <= 2 + int(STEPS * 0.01 / stream.STEP_INTERVAL_S) + 2 * len(rank.events) + 1
    for event in rank.events:  # the steps before each event came before it
        at = seen.index(("event", event.step))
        assert [s for kind, s in seen[:at] if kind == "step"] == list(range(event.step))


def test_slow_steps_are_sent_one_by_one():
    received: list[dict] = []
    channel = stream.RankChannel(received.append).open()
    model = tiny_llama()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    watch = nbguard.watch(model, optimizer=opt)
    clock = SteppedClock(step_s=1.0)  # a step per second: nothing to coalesce
    streamer = stream.RankStreamer(channel, rank=0, world_size=2, watch_id=watch.watch_id, clock=clock)
    watch.add_listener(streamer)
    try:
        _train(watch, model, opt, 5, clock)
    finally:
        channel.close()
        watch.detach()
    assert [len(m["payload"]) for m in received if m["kind"] == "steps"] == [1, 1, 1, 1, 1]


def _rank_that_exits_without_detaching(steps: int) -> None:
    model = tiny_llama()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    watch = nbguard.watch(model, optimizer=opt)
    streamer = stream.connect(watch, rank=1, world_size=2)
    assert streamer is not None
    streamer.interval = 3600.0  # only the first step goes at once: the rest wait for the exit
    _train(watch, model, opt, steps)


def test_steps_pending_when_a_forked_rank_exits_still_arrive():
    view = RankWatches(record=False)
    channel = _stream_from_a_forked_rank(view, _rank_that_exits_without_detaching, 7)
    assert view.ranks[1].history.steps == list(range(7))
    assert channel.received == 2  # attach, then the seven steps pending at the exit
