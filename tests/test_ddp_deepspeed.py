"""DeepSpeed's loss-scaler skips, read from the lines it logs (the fallback where the watch is given
no engine), without deepspeed installed. The lines are emitted through the same logger, at the same
level and with the same format strings as deepspeed 0.19.8's deepspeed/runtime/fp16/loss_scaler.py;
tests/test_deepspeed_engine.py checks the parser against a real engine's lines."""
import logging
import sys
import types

import torch

import nbguard
from nbguard.testing import tiny_batch, tiny_llama
from nbguard.watcher.distributed.deepspeed_skips import DeepSpeedSkips, parse_overflow

torch.set_num_threads(1)
LOGGER = logging.getLogger("DeepSpeed")


def _dynamic_overflow(cur_scale: int, next_scale: int) -> None:
    # DynamicLossScaler.update_scale on rank 0, fp16
    overflow_msg = f"[deepspeed] OVERFLOW! Rank {0} Skipping step."
    overflow_msg += f" Attempted loss scale: {int(cur_scale)}, reducing to {int(next_scale)}"
    LOGGER.info(overflow_msg)


def _watched():
    model = tiny_llama()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    return model, opt, nbguard.watch(model, optimizer=opt)


def _one_step(model, opt) -> None:
    model(**tiny_batch(2, 8)).loss.backward()
    opt.step()
    opt.zero_grad()


def test_parse_the_three_deepspeed_overflow_lines_and_nothing_else():
    assert parse_overflow("[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 65536, reducing to 32768") \
        == {"source": "deepspeed", "rank": 0, "attempted": 65536.0, "next": 32768.0}
    assert parse_overflow("[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 1024, but hysteresis "
                          "is 2. Reducing hysteresis to 1") == {"source": "deepspeed", "rank": 0, "attempted": 1024.0,
                                                                "hysteresis": 2}
    assert parse_overflow("[deepspeed] OVERFLOW! Skipping step. Gradients are non-finite, weights were not updated.") \
        == {"source": "deepspeed"}
    assert parse_overflow("[deepspeed] step=10, skipped=0, lr=[1e-05], mom=[(0.9, 0.999)]") is None


def test_a_streak_of_deepspeed_skips_is_a_skipped_steps_event():
    model, opt, watch = _watched()
    reader = DeepSpeedSkips(watch).attach()
    try:
        scale = 65536
        for _ in range(watch.settings.skip_streak):
            _dynamic_overflow(scale, scale // 2)
            scale //= 2
    finally:
        reader.detach()
        watch.detach()
    (event,) = watch.events
    assert event.kind == "skipped-steps" and event.evidence["source"] == "deepspeed"
    assert event.evidence["consecutive_skipped"] == watch.settings.skip_streak
    assert event.evidence["loss_scale"] == 65536 / 2 ** watch.settings.skip_streak
    assert LOGGER.handlers.count(reader) == 0  # detached: nothing left on DeepSpeed's logger


def test_an_optimizer_step_that_ran_ends_the_streak():
    model, opt, watch = _watched()
    reader = DeepSpeedSkips(watch).attach()
    try:
        for i in range(watch.settings.skip_streak + 2):
            if i == watch.settings.skip_streak // 2:
                _one_step(model, opt)  # DeepSpeed stepped once: no streak of skip_streak in a row
            _dynamic_overflow(1024, 512)
    finally:
        reader.detach()
        watch.detach()
    assert watch.events == [] and len(reader.skips) == watch.settings.skip_streak + 2


def test_the_watch_reads_deepspeed_lines_by_itself_once_deepspeed_is_imported(monkeypatch):
    model, opt, plain = _watched()
    assert plain._deepspeed is None  # no DeepSpeed in this process: no handler on its logger
    plain.detach()
    monkeypatch.setitem(sys.modules, "deepspeed", types.ModuleType("deepspeed"))
    model, opt, watch = _watched()
    try:
        assert watch._deepspeed is not None and watch._deepspeed in LOGGER.handlers
        for _ in range(watch.settings.skip_streak):
            _dynamic_overflow(8, 4)
    finally:
        watch.detach()
    assert [e.kind for e in watch.events] == ["skipped-steps"]
    assert not any(isinstance(h, DeepSpeedSkips) for h in LOGGER.handlers)
