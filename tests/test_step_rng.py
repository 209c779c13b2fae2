"""One RNG capture for the replay, the verifier and the audit: a restore reproduces every global generator's draws."""
from __future__ import annotations

import random

import numpy
import torch

from nbguard.step.capture import capture_rng, preserved_rng, restore_rng


def _draws() -> tuple[float, torch.Tensor, numpy.ndarray]:
    return random.random(), torch.rand(4), numpy.random.rand(3)


def _same(a, b) -> bool:
    return a[0] == b[0] and torch.equal(a[1], b[1]) and numpy.array_equal(a[2], b[2])


def test_a_restored_host_capture_reproduces_random_torch_and_numpy_draws():
    state = capture_rng(host=True)
    first = _draws()
    assert not _same(first, _draws())  # the generators moved on
    restore_rng(state)
    assert _same(_draws(), first)


def test_the_micro_batch_capture_holds_torch_only_and_its_restore_leaves_the_host_generators_alone():
    state = capture_rng()
    assert set(state) <= {"cpu", "cuda"}  # (what dropout draws: cheap enough for every micro-batch)
    expected = torch.rand(4)
    python_next = random.getstate()
    restore_rng(state)
    assert torch.equal(torch.rand(4), expected) and random.getstate() == python_next


def test_preserved_rng_puts_every_generator_back_even_when_the_block_raises():
    before = capture_rng(host=True)
    try:
        with preserved_rng():
            _draws()
            raise KeyError("a sampler failed")
    except KeyError:
        pass
    after = capture_rng(host=True)
    assert torch.equal(after["cpu"], before["cpu"]) and after["random"] == before["random"]
    assert all(numpy.array_equal(a, b) for a, b in zip(after["numpy"], before["numpy"]))
