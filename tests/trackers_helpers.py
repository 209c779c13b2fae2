"""Real tiny runs watched with ``log_to`` (plain loop or Trainer), with an optional planted NaN in backward."""
from __future__ import annotations

import math
import tempfile

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments
from watch_helpers import PoisonedSiLU, batches

import nbguard
from nbguard.testing import TinyDataset, tiny_llama
from nbguard.trackers.names import short_names

torch.set_num_threads(1)
BAD_STEP = 2


def poisoned_llama():
    """A tiny Llama whose layer-1 activation makes NaN in backward while ``act.armed``."""
    model = tiny_llama()
    act = model.model.layers[1].mlp.act_fn = PoisonedSiLU(armed=False)
    return model, act


def plain_run(log_to, steps: int = 4, bad_step: int | None = None, every: int = 1, scaler=None,
              activations: bool = False):
    """A plain loop (with ``scaler``: a GradScaler loop) watched with ``log_to``; returns the (detached) watch."""
    model, act = poisoned_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with nbguard.watch(model, optimizer=opt, scaler=scaler, policy="skip", verify=False, activations=activations,
                       log_to=log_to, log_every=every) as watch:
        for step, batch in enumerate(batches(steps)):
            act.armed = step == bad_step
            loss = model(**batch).loss
            if scaler is None:
                loss.backward()
                opt.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            opt.zero_grad(set_to_none=True)
    return watch


class _ArmAt(TrainerCallback):
    def __init__(self, module, step):
        self.module, self.step = module, step

    def on_step_begin(self, args, state, control, **kwargs):
        self.module.armed = state.global_step == self.step


def trainer_run(report_to: list[str], steps: int = 4, bad_step: int | None = None, output_dir: str | None = None,
                **args):
    """A Trainer reporting to ``report_to``, watched with ``log_to="report_to"``; returns (trainer, watch)."""
    model, act = poisoned_llama()
    arguments = TrainingArguments(output_dir=output_dir or tempfile.mkdtemp(), max_steps=steps,
                                  per_device_train_batch_size=2, use_cpu=True, report_to=report_to,
                                  save_strategy="no", logging_steps=1, disable_tqdm=True, **args)
    trainer = Trainer(model=model, args=arguments, train_dataset=TinyDataset(16),
                      callbacks=[_ArmAt(act, -1 if bad_step is None else bad_step)])
    watch = nbguard.watch(trainer, policy="skip", verify=False, log_to="report_to")
    trainer.train()
    watch.detach()
    return trainer, watch


def expected_scalars(watch) -> dict[int, dict[str, float]]:
    """step -> the scalars the tracker must hold, straight from ``watch.history``."""
    names = short_names(watch.history.groups)
    out: dict[int, dict[str, float]] = {}
    for i, step in enumerate(watch.history.steps):
        row = {f"nbguard/grad_norm/{names[g]}": watch.history.grad_norm(g)[i] for g in watch.history.groups}
        row["nbguard/loss"] = watch.history.loss[i]
        row["nbguard/total_grad_norm"] = watch.history.total_grad_norm[i]
        out[step] = row
    return out


def assert_matches_history(logged: dict[int, dict[str, float]], watch, step_offset: int = 0) -> None:
    """Every logged step's nbguard scalars equal the watch's own history (float32 precision)."""
    expected = expected_scalars(watch)
    assert sorted(logged) == [s + step_offset for s in sorted(expected)]
    for step, row in expected.items():
        got = logged[step + step_offset]
        for name, value in row.items():
            assert math.isclose(got[name], value, rel_tol=1e-6), (step, name, got[name], value)


def wandb_records(path) -> list:
    """The records of an offline W&B run file (``run-*.wandb``): a 7-byte header, then the LevelDB log
    format (32 KiB blocks of checksum(4) length(2) type(1) chunks; FULL=1 FIRST=2 MIDDLE=3 LAST=4),
    each record a ``wandb_internal.Record`` protobuf."""
    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    block, records, pending, pos = 32768, [], b"", 7
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        length = int.from_bytes(data[pos + 4:pos + 6], "little")
        kind = data[pos + 6]
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 0:
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records
