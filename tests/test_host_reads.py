"""Issue 45 item 4: the host reads nbguard's own code makes per healthy step, counted, not guessed.

A host read is any point where the CPU needs a tensor's value: ``aten::_local_scalar_dense`` (what
``item()``, ``bool(t)``, ``float(t)`` and ``if t:`` dispatch), ``aten::equal``, a device-to-host copy
(``_to_copy`` / ``copy_`` into host memory from a device), and ``Tensor.tolist()`` / ``Tensor.numpy()``,
which read a CPU tensor's memory without dispatching any op. A ``TorchDispatchMode`` sees the dispatched
ones; the two methods are wrapped for the count. Each read is charged to the first frame up the Python
stack that is neither torch's nor the standard library's: a read inside ``AdamW.step`` is the caller of
``step()``'s (the loop's or the Trainer's), a read inside a hook nbguard registered is nbguard's.

Today a healthy step costs exactly one read of nbguard's (the sentinel's one ``tolist()``), in a plain
loop and in a transformers Trainer, every default on. A second read added anywhere in nbguard makes this
fail, with the place it was added.
"""
from __future__ import annotations

import os
import sys
import sysconfig
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import nbguard
from nbguard.testing import TinyDataset, tiny_batch, tiny_llama

_TORCH = os.path.dirname(torch.__file__) + os.sep
_NBGUARD = os.path.dirname(nbguard.__file__) + os.sep
_STDLIB = os.path.realpath(sysconfig.get_paths()["stdlib"]) + os.sep  # (a venv's site-packages are not in it)
_SCALAR_READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.equal.default}
_COPIES = {torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default}
_COUNTER_FRAMES = {"__torch_dispatch__", "_charge", "read"}  # this file's own frames on the stack of a read


class HostReads(TorchDispatchMode):
    """Counts host reads by the place (``file:line``) charged with each; ``nbguard()`` keeps nbguard's."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: Counter[str] = Counter()
        self.landed = 0  # reads of host memory a non-blocking copy filled (see counting_host_reads)
        self._in_method = 0  # inside a wrapped tolist()/numpy(): its own copy to the host is that one read

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self._in_method and (func in _SCALAR_READS or (func in _COPIES and _to_host(func, args, kwargs))):
            self._charge()
        return func(*args, **kwargs)

    def _charge(self) -> None:
        frame: FrameType | None = sys._getframe(1)
        while frame is not None:
            code = frame.f_code
            path = os.path.realpath(code.co_filename)
            counter = code.co_filename == __file__ and code.co_name in _COUNTER_FRAMES
            if not counter and not code.co_filename.startswith("<frozen") and not path.startswith((_TORCH, _STDLIB)):
                self.sites[f"{path}:{frame.f_lineno}"] += 1
                return
            frame = frame.f_back
        self.sites["<no Python caller>"] += 1

    def nbguard(self) -> Counter[str]:
        return Counter({site: n for site, n in self.sites.items() if site.startswith(_NBGUARD)})

    def snapshot(self) -> Counter[str]:
        return Counter(self.nbguard())


def _to_host(func, args, kwargs) -> bool:
    """A copy into host memory from a device (``x.to("cpu")``, ``cpu_buffer.copy_(x)``)."""
    if func is torch.ops.aten.copy_.default:
        destination, source = args[0], args[1]
        return destination.device.type == "cpu" and source.device.type != "cpu"
    source, device = args[0], kwargs.get("device")
    return device is not None and torch.device(device).type == "cpu" and source.device.type != "cpu"


@contextmanager
def counting_host_reads(landed=lambda tensor: False) -> Iterator[HostReads]:
    """The dispatch mode, plus ``Tensor.tolist`` / ``Tensor.numpy`` wrapped (they dispatch nothing on CPU).
    ``landed(tensor)``: host memory a non-blocking copy filled a step earlier (read="deferred"'s mirror):
    reading it waits for nothing, so it is counted apart, in ``reads.landed``."""
    reads = HostReads()
    originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy")}

    def wrapped(name):
        original = originals[name]

        def read(self, *args, **kwargs):
            if landed(self):
                reads.landed += 1
                return original(self, *args, **kwargs)
            reads._charge()
            reads._in_method += 1
            try:
                return original(self, *args, **kwargs)
            finally:
                reads._in_method -= 1
        return read

    for name in originals:
        setattr(torch.Tensor, name, wrapped(name))
    try:
        with reads:
            yield reads
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def _per_step(snapshots: list[Counter[str]]) -> list[Counter[str]]:
    return [after - before for before, after in zip(snapshots, snapshots[1:])]


def test_the_counter_sees_every_kind_of_host_read():
    """Each way a value reaches the host counts once, charged to the line that asked; ops that stay on
    the device count nothing."""
    t = torch.tensor([1.5, 2.0])
    with counting_host_reads() as reads:
        line = sys._getframe().f_lineno + 1
        t.sum().item(), bool(t[0]), float(t[1]), t.tolist(), t.numpy(), torch.equal(t, t), int(t[0] > 1)
        if t[0] > 0:
            pass
        torch.stack([t.norm(), t.sum()]).mul_(2).clone()  # device work only
    here = os.path.realpath(__file__)
    assert reads.sites == Counter({f"{here}:{line}": 7, f"{here}:{line + 1}": 1})


def _plain_loop(steps: int, loop: str = "model's loss", read: str = "host", policy: str = "warn",
                fused: bool | None = None, landed: list[int] | None = None,
                ) -> tuple[list[Counter[str]], nbguard.watcher.NanWatch]:
    """A plain loop every default on (clip, AdamW, a GradScaler-free fp32 step); the reads of each step. ``loop``:
    the model's own loss, a loss computed after the model (read at backward's root), or a step(closure).
    ``read``: the watch's read mode; ``landed`` gets, per step, the reads of the deferred mode's host mirror."""
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
    watch = nbguard.watch(model, optimizer=opt, policy=policy, settings=nbguard.watcher.WatchSettings(read=read))
    snapshots = []
    with counting_host_reads(landed=lambda t: watch._mirror.holds(t)) as reads:
        for step in range(steps):
            if landed is not None:
                landed.append(reads.landed)
            snapshots.append(reads.snapshot())
            batch = tiny_batch(seed=step)

            def forward_backward(batch=batch):
                if loop == "model's loss":
                    loss = model(**batch).loss
                else:
                    logits = model(input_ids=batch["input_ids"]).logits
                    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten())
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                return loss

            if loop == "step(closure)":
                opt.step(forward_backward)
            else:
                forward_backward()
                opt.step()
            opt.zero_grad(set_to_none=True)
        snapshots.append(reads.snapshot())
        if landed is not None:
            landed.append(reads.landed)
    watch.detach()
    return _per_step(snapshots), watch


@pytest.mark.parametrize("loop", ["model's loss", "loss after the model", "step(closure)"])
def test_a_healthy_plain_loop_step_costs_one_host_read_of_nbguards(loop):
    steps = 12  # past the first steps' one-time work, and over a weight fingerprint (every 10th step)
    per_step, watch = _plain_loop(steps, loop)
    assert watch.events == [] and watch.step == steps
    assert [sum(c.values()) for c in per_step] == [1] * steps, per_step
    (site,) = set().union(*per_step)  # every step's one read is the same one: the sentinel's
    assert os.sep + os.path.join("watcher", "reads", "sentinel.py") in site, site


@pytest.mark.parametrize("read, expected", [("host", 1), ("deferred", 0)])
def test_a_healthy_trainer_step_costs_one_host_read_of_nbguards(tmp_path, read, expected):
    """The host mode: one read per step; read="deferred": none (the Trainer's fused AdamW skips on the device)."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    steps = 12
    snapshots: list[Counter[str]] = []
    reads_box: list[HostReads] = []

    class EachStep(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if not snapshots:
                snapshots.append(reads_box[0].snapshot())

        def on_step_end(self, args, state, control, **kwargs):
            snapshots.append(reads_box[0].snapshot())

    args = TrainingArguments(output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, use_cpu=True, report_to=[], save_strategy="no",
                             logging_steps=5, disable_tqdm=True, seed=0)
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=TinyDataset(64), callbacks=[EachStep()])
    watch = nbguard.watch(trainer, policy="skip", settings=nbguard.watcher.WatchSettings(read=read))
    with counting_host_reads(landed=lambda t: watch._mirror.holds(t)) as reads:
        reads_box.append(reads)
        trainer.train()
    watch.detach()
    assert watch.events == [] and watch.step == steps  # (deferred: the last step judged at the end of train())
    per_step = _per_step(snapshots)
    assert len(per_step) == steps
    assert [sum(c.values()) for c in per_step] == [expected] * steps, per_step
    if expected:
        (site,) = set().union(*per_step)
        assert os.sep + os.path.join("watcher", "reads", "sentinel.py") in site, site
    else:
        assert reads.landed == steps  # each step's numbers read once, from the host mirror
    # (the Trainer's own reads, its loss filter and logging, are its own: not counted above)
    assert sum(reads.sites.values()) > sum(reads.nbguard().values())


def test_a_second_read_in_nbguards_step_is_counted_with_its_place(monkeypatch):
    """What the count is for: nbguard's code reading once more per step (here the update norms read at
    once, as their flush at the end of training does, instead of riding in the next step's read) shows."""
    from nbguard.watcher.components.update_norms import UpdateNorms

    original = UpdateNorms.after_step

    def and_read_now(self, step):
        original(self, step)
        self.flush()

    monkeypatch.setattr(UpdateNorms, "after_step", and_read_now)
    per_step, _ = _plain_loop(3)
    assert [sum(c.values()) for c in per_step] == [2] * 3, per_step
    assert all(any("update_norms.py" in site for site in c) for c in per_step)


@pytest.mark.parametrize("policy, fused", [("warn", None), ("skip", True)], ids=["warn", "skip on the device"])
def test_read_deferred_costs_no_host_read_per_healthy_step(policy, fused):
    """Issue 45: the verdict stays on the device and the numbers reach the host without a wait; each step reads
    only host memory a non-blocking copy filled a step earlier (on a GPU: pinned, after its event)."""
    steps = 12
    landed: list[int] = []
    per_step, watch = _plain_loop(steps, read="deferred", policy=policy, fused=fused, landed=landed)
    assert [sum(c.values()) for c in per_step] == [0] * steps, per_step
    # from the second step on, each reads the step before it: one read of the mirror each
    assert [after - before for before, after in zip(landed, landed[1:])] == [0] + [1] * (steps - 1)
    assert watch.events == [] and watch.step == steps  # the last step was judged at detach
    assert len(watch.history.loss) == steps
