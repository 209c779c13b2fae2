"""Stalls and slowdowns (issue 34 item 6): the heartbeat's ``stall`` event and the ``slow-steps`` event.

Real runs: a tiny Llama in a plain loop fed by a real DataLoader, and a real transformers Trainer. A stall
is made for real by a collate function that blocks on a ``threading.Event``; the watch's own listener
releases it once the stall event is recorded (so a missing event shows as a 10 s wait and a failed
assertion, never as a hung test). A slowdown is a collate function that sleeps from a given batch on.
"""
from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import time
from typing import IO, cast

import pytest
import torch
from transformers import Trainer, TrainingArguments, default_data_collator

import nbguard
from nbguard.testing import TinyDataset, tiny_batch, tiny_llama
from nbguard.watcher.components.stall import THREAD_NAME, StepClock, check_stall_after

STALL_AFTER_S = 0.25  # the floor, small so the stall shows within a second
RELEASE_AFTER_S = 10.0  # a collate left blocked this long means no stall event came


_EARLIER: set[threading.Thread] = set()


@pytest.fixture(autouse=True)
def _earlier_watches_heartbeats():
    """Heartbeats of watches other test files in this process left attached (alive until their watch is
    collected) are not this test's: the counts below are of the threads this test started."""
    gc.collect()
    _EARLIER.clear()
    _EARLIER.update(t for t in threading.enumerate() if t.name == THREAD_NAME)
    yield


def heartbeats() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == THREAD_NAME and t not in _EARLIER]


def kinds(watch) -> list[str]:
    return [e.kind for e in watch.events]


class Gate:
    """Released by the watch's listener when a stall event is recorded."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.released_by_stall: bool | None = None

    def listener(self, watch, kind, payload) -> None:
        if kind == "event" and payload.kind == "stall":
            self.event.set()



class Indices(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return index


def loader(batches: int, block_at: int | None = None, gate: Gate | None = None, slow_from: int | None = None,
           slow_until: int = 10**9, sleep_s: float = 0.0) -> torch.utils.data.DataLoader:
    """A real DataLoader (workers 0: collate runs on the training thread) whose collate blocks or sleeps."""

    def blocking_collate(indices):
        (index,) = indices
        if index == block_at and gate is not None:
            gate.released_by_stall = gate.event.wait(RELEASE_AFTER_S)
        if slow_from is not None and slow_from <= index < slow_until:
            time.sleep(sleep_s)
        return tiny_batch(4, 16, seed=index)

    return torch.utils.data.DataLoader(Indices(batches), batch_size=1, collate_fn=blocking_collate)


def train(model, optimizer, data) -> None:
    for batch in data:
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def clock_of(watch) -> StepClock:
    """The watch's stall component (one of its detectors, as every component is)."""
    (clock,) = [d for d in watch.detectors if isinstance(d, StepClock)]
    return clock


def watched(stall_after_s=STALL_AFTER_S):
    torch.manual_seed(0)
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    watch = nbguard.watch(model, optimizer=optimizer, verify=False, log_to=None,
                          config=nbguard.WatchConfig(stall={"after_s": stall_after_s}))
    return model, optimizer, watch


def test_a_dataloader_that_blocks_is_one_stall_event_with_the_blocking_frame():
    model, optimizer, watch = watched()
    gate = Gate()
    watch.add_listener(gate.listener)
    try:
        assert len(heartbeats()) == 1
        train(model, optimizer, loader(10, block_at=7, gate=gate))
    finally:
        watch.detach()
    assert gate.released_by_stall is True, "no stall event while the collate function blocked"
    assert kinds(watch) == ["stall"], watch.summary()
    event = watch.events[0]
    evidence = event.evidence
    assert evidence["after_step"] == 6 and event.step == 7  # waiting after step 6, for step 7
    assert evidence["user_frame"].startswith("blocking_collate ")  # the innermost frame of the user's code
    first = evidence["stacks"][0]
    assert first["training"] and first["thread"] == "MainThread"
    assert "in blocking_collate" in first["stack"] and "gate.event.wait(RELEASE_AFTER_S)" in first["stack"]
    assert evidence["waiting_in"].startswith("wait ")  # threading.Event.wait, inside the collate
    assert all(THREAD_NAME != s["thread"] for s in evidence["stacks"])  # the heartbeat's own stack is left out
    assert evidence["waited_s"] >= evidence["bound_s"] >= STALL_AFTER_S
    assert evidence["collective"] is None and event.rank is None
    # the run resumed: said on the same event, once
    assert evidence["resumed_at_step"] == 7 and evidence["stalled_s"] >= evidence["waited_s"]
    assert "resumed at step 7" in event.message and "blocking_collate" in event.message
    assert heartbeats() == []
    # the event is in the watch's document and in the report like any other
    doc = watch.to_document()
    assert [e["kind"] for e in doc["events"]] == ["stall"]
    assert "blocking_collate" in doc["events"][0]["evidence"]["stacks"][0]["stack"]


def test_a_healthy_run_is_quiet_and_an_idle_watch_after_its_loop_is_no_stall():
    """The healthy twin of both: as many steps as the slow run, with the stall floor of the blocked one."""
    model, optimizer, watch = watched()
    try:
        train(model, optimizer, loader(24))
        assert watch.step == 24 and watch.events == [], watch.summary()
        # the loop's frame (train) returned: nothing is awaited, however long the watch stays attached
        bound, _ = clock_of(watch).bound()
        time.sleep(bound + 0.3)
        assert watch.events == [], watch.summary()
        assert len(heartbeats()) == 1  # still running, only not judging
        train(model, optimizer, loader(3))  # a new loop arms it again; the pause between loops is not a step time
        assert watch.step == 27 and watch.events == []
        assert max(clock_of(watch).gaps) < bound
    finally:
        watch.detach()
    assert heartbeats() == []


def test_steps_made_slow_by_a_sleeping_collate_are_one_slow_steps_event():
    model, optimizer, watch = watched(stall_after_s=60.0)
    try:
        train(model, optimizer, loader(24, slow_from=14, slow_until=20, sleep_s=0.25))
    finally:
        watch.detach()
    assert kinds(watch) == ["slow-steps"], watch.summary()
    event = watch.events[0]
    evidence = event.evidence
    assert event.step == evidence["first_step"] == 14
    assert evidence["steps"] == 6 and evidence["last_step"] == 19 and evidence["recovered_at_step"] == 20
    assert evidence["ratio"] > 3 and len(evidence["recent_s"]) == 6
    assert "dataloader gone synchronous" in event.message and "silent CPU fallback" in event.message


BURNERS = 12  # spinning processes on the training thread's core: a step takes 13x its work on an idle core, and
# still over 3x where CI's load already puts three more tasks on that core


class PinnedBurners:
    """From batch ``start`` to batch ``stop`` of a loop pinned to one core, BURNERS processes spin on that
    same core: other processes taking the CPU (a neighbour on a shared machine, CI lanes beside the tests)."""

    def __init__(self, start: int, stop: int) -> None:
        self.start, self.stop = start, stop
        self.cpu = min(os.sched_getaffinity(0))
        self.procs: list[subprocess.Popen] = []

    def at(self, index: int) -> None:
        if index == self.start:
            self.procs = [subprocess.Popen([sys.executable, "-S", "-c", "while True: pass"],
                                           preexec_fn=lambda: os.sched_setaffinity(0, {self.cpu}))
                          for _ in range(BURNERS)]
        elif index == self.stop:
            for proc in self.procs:
                proc.kill()  # reaped after the loop: waiting here would be this step's own time

    def end(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()
        self.procs = []


def train_pinned(model, optimizer, batches: int, burners: PinnedBurners, sleep_from: int | None = None) -> None:
    """A loop on one core with one torch thread (the training thread, alone with the burners on its core)."""
    threads, affinity = torch.get_num_threads(), os.sched_getaffinity(0)
    torch.set_num_threads(1)
    os.sched_setaffinity(0, {burners.cpu})  # this thread only (Linux: pid 0 is the calling thread)
    try:
        for index in range(batches):
            burners.at(index)
            if sleep_from is not None and sleep_from <= index < burners.stop:
                time.sleep(0.5)  # the step's own slowness: a dataloader that sleeps
            batch = tiny_batch(8, 32, seed=index)
            model(**batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    finally:
        burners.end()
        os.sched_setaffinity(0, affinity)
        torch.set_num_threads(threads)


linux_only = pytest.mark.skipif(not os.path.exists("/proc/self/task") or not hasattr(os, "sched_setaffinity"),
                                reason="the wait for a CPU is read from Linux's /proc/<pid>/task/<tid>/schedstat")


@linux_only
def test_steps_slowed_by_other_processes_taking_the_cpu_are_no_slow_steps():
    """Six steps in which twelve processes spin on the training thread's core: over 3x the median on the
    clock, but the time is the thread waiting for its core, so the watch stays quiet."""
    model, optimizer, watch = watched(stall_after_s=60.0)
    clock = clock_of(watch)
    try:
        train_pinned(model, optimizer, 24, PinnedBurners(14, 20))
    finally:
        watch.detach()
    assert watch.events == [], watch.summary()
    assert clock.load_slowed >= 1  # the loaded steps were over the threshold, and judged less their wait


@linux_only
def test_steps_slow_for_their_own_work_are_slow_steps_under_the_same_load():
    """The same load with a dataloader that sleeps 0.5 s in those steps: slow for the run's own reason."""
    model, optimizer, watch = watched(stall_after_s=60.0)
    try:
        train_pinned(model, optimizer, 24, PinnedBurners(14, 20), sleep_from=14)
    finally:
        watch.detach()
    assert kinds(watch) == ["slow-steps"], watch.summary()
    evidence = watch.events[0].evidence
    assert evidence["first_step"] == 14 and evidence["steps"] == 6, evidence
    # the burners killed at step 20 may still hold the core in it: then step 21 is the first ordinary one
    assert evidence["recovered_at_step"] >= 20, evidence


def tiny_trainer(tmp_path, collator, max_steps):
    torch.manual_seed(0)
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], save_strategy="no",
                             per_device_train_batch_size=4, max_steps=max_steps, logging_steps=1,
                             learning_rate=1e-4, disable_tqdm=True, dataloader_num_workers=0)
    return Trainer(model=tiny_llama(), args=args, train_dataset=TinyDataset(16, 16), data_collator=collator)


def test_a_trainer_whose_collator_blocks_is_one_stall_event_and_its_twin_is_quiet(tmp_path):
    gate = Gate()
    calls = []

    def stuck_collator(features):
        calls.append(len(features))
        if len(calls) == 6:
            gate.released_by_stall = gate.event.wait(RELEASE_AFTER_S)
        return default_data_collator(features)

    trainer = tiny_trainer(tmp_path / "stuck", stuck_collator, max_steps=8)
    watch = nbguard.watch(trainer, verify=False, log_to=None, config=nbguard.WatchConfig(stall={"after_s": STALL_AFTER_S}))
    watch.add_listener(gate.listener)
    try:
        trainer.train()
    finally:
        watch.detach()
    assert gate.released_by_stall is True
    assert kinds(watch) == ["stall"], watch.summary()
    evidence = watch.events[0].evidence
    stack = evidence["stacks"][0]["stack"]
    assert "in stuck_collator" in stack and "_inner_training_loop" in stack
    assert evidence["user_frame"].startswith("stuck_collator ") and "resumed_at_step" in evidence

    healthy = tiny_trainer(tmp_path / "healthy", default_data_collator, max_steps=8)
    twin = nbguard.watch(healthy, verify=False, log_to=None, config=nbguard.WatchConfig(stall={"after_s": STALL_AFTER_S}))
    try:
        healthy.train()
        assert twin.step == 8 and twin.events == [], twin.summary()
        # train() returned: the test's own frame is still running, but no step is awaited any more
        time.sleep(clock_of(twin).bound()[0] + 0.3)
        assert twin.events == [], twin.summary()
    finally:
        twin.detach()
    assert heartbeats() == []


def test_detach_ends_the_heartbeat_and_none_turns_it_off():
    model, optimizer, watch = watched()
    thread = heartbeats()
    assert len(thread) == 1 and thread[0].daemon
    watch.detach()
    assert not thread[0].is_alive() and heartbeats() == []
    watch.attach()  # attaching again starts a new one
    assert len(heartbeats()) == 1
    watch.detach()
    assert heartbeats() == []
    _, _, off = watched(stall_after_s=None)
    try:
        assert heartbeats() == []
    finally:
        off.detach()


@pytest.mark.parametrize(("value", "error"), [(-1, ValueError), (0, ValueError), (float("nan"), ValueError),
                                              (float("inf"), ValueError), ("60", TypeError), (True, TypeError)])
def test_a_bad_stall_after_s_is_a_clear_error(value, error):
    with pytest.raises(error, match="stall_after_s"):
        check_stall_after(value)
    model = tiny_llama()
    with pytest.raises(error, match="after_s"):
        nbguard.watch(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                      config=nbguard.WatchConfig(stall={"after_s": value}))
    with pytest.raises(error, match="stall_after_s"), pytest.warns(DeprecationWarning, match="WatchConfig"):
        nbguard.watch(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), stall_after_s=value)
    assert heartbeats() == []


def test_the_old_stall_after_s_keyword_still_sets_the_stall_section():
    """One release of grace: stall_after_s= is the stall section's after_s, with a DeprecationWarning."""
    model = tiny_llama()
    with pytest.warns(DeprecationWarning, match=r"WatchConfig\(stall="):
        watch = nbguard.watch(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), verify=False,
                              log_to=None, stall_after_s=None)
    try:
        assert watch.config.section("stall").after_s is None and heartbeats() == []
    finally:
        watch.detach()


def test_a_failure_inside_the_heartbeat_is_one_watch_error_and_training_goes_on(monkeypatch):
    model, optimizer, watch = watched()
    clock = clock_of(watch)

    def broken_bound():
        raise RuntimeError("bound exploded")

    monkeypatch.setattr(clock, "bound", broken_bound)
    try:
        train(model, optimizer, loader(2))
        deadline = time.monotonic() + 5
        while not watch.events and time.monotonic() < deadline:
            time.sleep(0.02)
        assert kinds(watch) == ["watch-error"]
        assert "stall heartbeat failed" in watch.events[0].message and "bound exploded" in watch.events[0].message
        assert heartbeats() == []  # the heartbeat stopped; the watch did not
        assert watch.active
        train(model, optimizer, loader(2))
        assert watch.step == 4 and kinds(watch) == ["watch-error"]
    finally:
        watch.detach()


SAVE_LOOKS = 5  # heartbeat looks that found the training thread inside the save, before the test lets it end
SAVE_BOUNDS = 4  # ... and the save has lasted this many stall bounds (a silence that long would be a stall)


def slow_save_pretrained(model, watch, released: list[bool]):
    """Patch the model instance's ``save_pretrained`` (what the Trainer's checkpoint save calls) so it returns
    only once the heartbeat has looked at the save SAVE_LOOKS times and it has lasted SAVE_BOUNDS bounds: a
    save far past the bound, made long by the heartbeat's own progress, never by a fixed sleep."""
    real = model.save_pretrained
    clock = clock_of(watch)

    def save_pretrained(*args, **kwargs):
        deadline = time.monotonic() + RELEASE_AFTER_S
        done = threading.Event()
        while time.monotonic() < deadline:
            seen = clock.saving
            if (seen is not None and seen["looks"] >= SAVE_LOOKS
                    and time.monotonic() - seen["since"] >= SAVE_BOUNDS * clock.bound()[0]):
                released.append(True)
                break
            done.wait(0.01)  # a poll of the heartbeat's state, not the proof
        else:
            released.append(False)
        return real(*args, **kwargs)

    model.save_pretrained = save_pretrained


def test_a_checkpoint_save_longer_than_the_bound_is_no_stall_and_a_block_after_it_still_is(tmp_path):
    """A Trainer saving every 5 steps whose first save lasts 4 bounds (learned from the run, at the floor)
    is no stall and its gap is not learned; its collator blocking 3 steps later is one stall, as before."""
    gate = Gate()
    calls = []

    def stuck_collator(features):
        calls.append(len(features))
        if len(calls) == 9:  # the batch of step 8 (after the save at step 5)
            gate.released_by_stall = gate.event.wait(RELEASE_AFTER_S)
        return default_data_collator(features)

    torch.manual_seed(0)
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], save_strategy="steps",
                             save_steps=5, save_only_model=True, per_device_train_batch_size=4, max_steps=10,
                             logging_steps=1, learning_rate=1e-4, disable_tqdm=True, dataloader_num_workers=0)
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=TinyDataset(16, 16), data_collator=stuck_collator)
    watch = nbguard.watch(trainer, verify=False, log_to=None, config=nbguard.WatchConfig(stall={"after_s": STALL_AFTER_S}))
    watch.add_listener(gate.listener)
    released: list[bool] = []
    slow_save_pretrained(trainer.model, watch, released)
    clock = clock_of(watch)
    tick = clock.heartbeat.tick
    try:
        trainer.train()
    finally:
        watch.detach()
    assert released[:1] == [True], "the heartbeat never saw the training thread inside the save"
    assert (tmp_path / "checkpoint-5" / "model.safetensors").exists() and watch.step == 10
    # the save: no event; the heartbeat saw it, from the Trainer's _save_checkpoint, and timed it
    [(where, seconds), *_] = clock.saves
    assert where.startswith("_save_checkpoint ") and "transformers" in where
    # timed from the first look that saw the save to the last: up to two ticks short of its whole length
    # (a fresh-clone CI run measured 0.991 s of a save held 1.0 s)
    assert seconds >= SAVE_BOUNDS * STALL_AFTER_S - 2 * tick
    assert max(clock.gaps) < seconds  # the save's gap was not learned as a step time
    # the collator that blocks after it: one stall, the save nowhere in it
    assert gate.released_by_stall is True
    assert kinds(watch) == ["stall"], watch.summary()
    event = watch.events[0]
    assert event.step == 8 and event.evidence["user_frame"].startswith("stuck_collator ")
    assert "saving" not in event.evidence and "checkpoint save" not in event.message
    assert heartbeats() == []


def test_a_save_that_never_ends_is_a_stall_that_says_it_is_inside_the_save():
    """A torch.save in a plain loop that blocks (a hung filesystem): past SAVE_FACTOR bounds it is a stall,
    and the event names the save; released by the event itself."""
    from nbguard.watcher.components.stall import SAVE_FACTOR

    model, optimizer, watch = watched()
    gate = Gate()
    watch.add_listener(gate.listener)

    class HungFile:
        """A file whose write blocks until the stall event (torch.save writes through it)."""

        def __init__(self) -> None:
            self.chunks: list[bytes] = []

        def write(self, data) -> int:
            if gate.released_by_stall is None:
                gate.released_by_stall = gate.event.wait(RELEASE_AFTER_S + 5 * SAVE_FACTOR * STALL_AFTER_S)
            self.chunks.append(bytes(data))
            return len(data)

        def flush(self) -> None:
            pass

    def train_and_save(data) -> None:
        for index, batch in enumerate(data):
            model(**batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if index == 5:
                torch.save({"step": index, "lm_head": model.lm_head.weight.detach()}, cast(IO[bytes], HungFile()))

    try:
        train_and_save(loader(8))
    finally:
        watch.detach()
    assert gate.released_by_stall is True
    assert kinds(watch) == ["stall"], watch.summary()
    event = watch.events[0]
    evidence = event.evidence
    assert evidence["after_step"] == 5 and evidence["saving"].startswith("save ") and "serialization.py" in \
        evidence["saving"]
    assert evidence["bound_s"] >= SAVE_FACTOR * STALL_AFTER_S and "inside a checkpoint save" in evidence["bound_from"]
    assert "inside a checkpoint save (save " in event.message and "resumed at step 6" in event.message
    assert "in write" in evidence["stacks"][0]["stack"]


def test_the_step_a_rewind_restores_in_is_not_a_step_time():
    """Restoring a snapshot is the watch's own work: that step's gap neither learns the baseline nor
    counts toward slow steps (a rewind on a loaded machine looked like a slowdown)."""
    model, optimizer, watch = watched(stall_after_s=60.0)
    clock = clock_of(watch)
    timed = []
    try:
        for i, batch in enumerate(loader(8)):  # one loop: every gap but the first is a step time
            model(**batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            timed.append(clock.timed)
            if i == 4:
                clock.rewound(watch.step)  # (what policy rewind tells every component after a restore)
    finally:
        watch.detach()
    assert timed[1:5] == [1, 2, 3, 4]
    assert timed[5] == timed[4] and timed[6] == timed[5] + 1
