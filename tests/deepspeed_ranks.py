"""One rank of a real two-rank DeepSpeed ZeRO run on its CPU accelerator (gloo), launched by
tests/test_deepspeed_engine.py through torchrun. Each rank writes what the watch reported next to
what the engine really did, read here after every ``engine.step()`` independently of the watch.

Scenarios (rank 1's loss is multiplied by inf at the planted steps):
- ``bf16``: bf16, ZeRO stage 2, one planted step (BAD_STEP);
- ``fp16``: fp16 with DeepSpeed's dynamic loss scaler, ZeRO stage 1, STREAK planted steps in a row.
"""
from __future__ import annotations

import inspect
import json
import logging
import sys
import warnings
from pathlib import Path

import torch

STEPS = 6
BAD_STEP = 2
STREAK = 3  # the watch's skip_streak in the fp16 scenario


class OverflowLines(logging.Handler):
    """Every line DeepSpeed logs, to check the log-line fallback's parser against the real ones."""

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _config(scenario: str) -> dict:
    config: dict = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10_000,
                    "zero_allow_untested_optimizer": True}  # a torch optimizer: no compiled DeepSpeed op
    if scenario == "fp16":
        config.update(fp16={"enabled": True, "initial_scale_power": 8, "hysteresis": 1},
                      zero_optimization={"stage": 1})
    else:
        config.update(bf16={"enabled": True}, zero_optimization={"stage": 2})
    return config


def _planted(scenario: str, step: int) -> bool:
    return BAD_STEP <= step < BAD_STEP + (STREAK if scenario == "fp16" else 1)


def main(scenario: str, policy: str, out_dir: str) -> None:
    import deepspeed
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    import nbguard
    from nbguard.errors import NonFiniteError
    from nbguard.testing import tiny_batch, tiny_llama

    torch.set_num_threads(1)
    if scenario == "fp16":
        # DeepSpeed's CPU accelerator refuses fp16 where oneDNN has no fp16 kernels (this CPU: no
        # AVX512-FP16/AMX); torch still computes fp16 on CPU, and the loss scaler under test is plain Python
        type(get_accelerator()).is_fp16_supported = lambda self: True
    lines = OverflowLines()
    ds_logger = logging.getLogger("DeepSpeed")
    ds_logger.addHandler(lines)
    ds_logger.setLevel(logging.INFO)  # the dynamic scaler's overflow line is at INFO
    model = tiny_llama()
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                                           config=_config(scenario))
    rank = dist.get_rank()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        watch = nbguard.watch(engine, optimizer=engine.optimizer, policy=policy)
    watch.settings.skip_streak = STREAK  # (the readers share the watch's settings)
    # the wrappers keep what user code sees (accelerate and the Trainer read these methods' signatures):
    # the engine's own method, bound, against the watch's wrapper (deepspeed's decorators name theirs)
    originals = {name: getattr(type(engine), name).__get__(engine) for name in ("step", "backward")}
    signatures = {name: [str(inspect.signature(getattr(engine, name))), getattr(engine, name).__name__,
                         str(inspect.signature(original)), original.__name__] for name, original in originals.items()}
    truth: list[dict] = []
    stopped = None
    try:
        for step in range(STEPS):
            loss = engine(**tiny_batch(2, 8)).loss
            if rank == 1 and _planted(scenario, step):
                loss = loss * float("inf")
            engine.backward(loss)
            try:
                engine.step()
            finally:  # a stop raises after the engine's step: record what it did first
                norm = engine.get_global_grad_norm()
                truth.append({"skipped_steps": engine.skipped_steps, "applied": engine.was_step_applied(),
                              "global_steps": engine.global_steps,
                              "grad_norm": None if norm is None else float(norm),
                              "loss_scale": float(engine.optimizer.cur_scale) if engine.fp16_enabled() else None})
    except NonFiniteError as err:
        stopped = {"message": str(err), "at_engine_step": len(truth)}
    reader = watch._deepspeed
    result = {"rank": rank, "world_size": dist.get_world_size(), "stopped": stopped, "truth": truth,
              "reader": type(reader).__name__, "readings": reader.readings(),
              "events": [e.to_dict() for e in watch.events], "watch_failed": watch._broken,
              "deepspeed_lines": lines.lines, "warned": [str(w.message) for w in caught if "nbguard" in str(w.message)],
              "signatures": signatures,
              "weights_finite": all(bool(torch.isfinite(p.detach()).all()) for p in engine.module.parameters())}
    watch.detach()
    result["restored"] = "step" not in engine.__dict__ and "backward" not in engine.__dict__
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result, default=str))
    dist.barrier()  # both ranks finished: nobody left waiting in a collective
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
