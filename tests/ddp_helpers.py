"""Two-rank DDP runs for the watch (gloo on CPU), launched the ways users launch them.

``train_rank(scenario, policy, out_dir)`` is the user's training function: an accelerate loop
with ``nbguard.watch`` inside it. Each rank writes what it saw to ``out_dir/rank{N}.json``; the
tests read those files. ``launch_notebook`` / ``launch_torchrun`` run it through accelerate's
``notebook_launcher`` (forked workers, as in a notebook) and through ``torchrun``, each in a new
session whose process tree is stopped when it hangs (its processes stop using the CPU; a run that is
only slow on a busy machine goes on): a hang fails the test instead of hanging it.

Scenarios (faults on rank 1 only; rank 0's batches are healthy):
  healthy   - nothing planted
  forward   - rank 1's batch holds a token that overflows fp16 in layer 0's q_proj (fp16 autocast)
  backward  - rank 1's layer-1 SiLU makes NaN in backward (its forward stays finite)
  loss      - rank 1's batch has every label -100: its mean loss is 0/0
  uncaught  - as forward, but the function does not catch nbguard's NonFiniteError (policy stop)
  rank0only - healthy, but only rank 0 attaches a watch: it must watch alone, not wait for rank 1
  unwatched - healthy, no watch on any rank (the reference the healthy run's weights must equal)
  accumulate - healthy, two micro-batches per optimizer step, each reduced (no no_sync), read from DDP's
              buckets; accumulate-hooks - the same with a communication hook of the user's registered
              first, so the watch reads with a hook per parameter (the reference)
  scaler    - fp16 autocast + GradScaler; rank 1's batches overflow from BAD_STEP on: the scaler
              skips every step on both ranks (the all-reduced grads are inf), a streak of 2 is an event
  fail      - rank 1's watch hits an internal error in its step read: it must step aside without
              leaving rank 0 blocked in the step's collective
  <scenario>+fused, <scenario>+deferred - the same with torch's fused AdamW (the device skip's optimizer),
              read on the host / one step late (``WatchSettings(read="deferred")``); ``+deferred`` also counts
              the host reads nbguard's own code makes at each step (tests/test_host_reads.py's counter)
``train_rewind_rank``: an LR blow-up on every rank, for policy rewind across ranks.
``train_uneven_rank``: uneven supervised tokens per rank, with and without normalising across ranks.

Several scenarios per launch: a launch costs ~13-17 s of process start-up (torch, transformers,
accelerate, the gloo group) where a scenario takes under a second, so ``launch_batch`` runs a list of
scenarios one after another in one process group (``run_scenarios``), each with a fresh model, optimizer
and watch, in its own folder; it checks before each scenario (and after the last) that no watch is attached
and torch's clipping functions are torch's own, so a scenario starts clean and detach leaves nothing behind.
A scenario that raises records its traceback in its folder and ends the launch; the scenarios after it are
launched again without it, so a failure fails its own test only, with its own output
(``Batch.ranks``). ``NOTEBOOK_BATCH`` / ``TORCHRUN_BATCH`` are the shared launches (``shared_batch``: one
launch per pytest run, whichever xdist worker asks first). Scenarios that cannot share a process keep a
launch of their own: ``uncaught`` (it kills the ranks), the stall tests (a rank blocks), the streamed run
(the kernel side is the launcher's parent).
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import torch

REPO = Path(__file__).resolve().parent.parent
# torch's clipping functions as imported, before any watch patched them (nbguard.watcher.reads.clip_tap's targets)
_CLIP_FUNCTIONS = {(module, name): getattr(module, name, None)
                   for module in (torch.nn.utils, torch.nn.utils.clip_grad)
                   for name in ("clip_grad_norm_", "clip_grads_with_norm_", "clip_grad_value_")}
STEPS = 4
BAD_STEP = 1
HOT_TOKEN = 7


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _batches(rank: int, scenario: str) -> list[dict[str, torch.Tensor]]:
    from nbguard.testing import tiny_batch

    out = []
    for step in range(STEPS):
        b = tiny_batch(2, 12, seed=100 * rank + step)
        for key in ("input_ids", "labels"):  # the hot token only where it is planted
            b[key] = torch.where(b[key] == HOT_TOKEN, torch.full_like(b[key], HOT_TOKEN + 1), b[key])
        if rank == 1 and scenario == "scaler" and step >= BAD_STEP:
            b["input_ids"][0, 3] = HOT_TOKEN  # every step from BAD_STEP on: a streak of GradScaler skips
        if rank == 1 and step == BAD_STEP:
            if scenario in ("forward", "uncaught"):
                b["input_ids"][0, 3] = HOT_TOKEN
            elif scenario == "loss":
                b["labels"][:] = -100
        out.append(b)
    return out


def _break_read(watch) -> None:
    """An internal failure of the watch on this rank: from step BAD_STEP its step read raises (its gather,
    which both read modes call before their part of the step's exchange, the hardest moment for the peers)."""
    real = watch._collector.gather

    def gather(*args, **kwargs):
        if watch.step >= BAD_STEP:
            raise RuntimeError("planted failure inside nbguard's step read")
        return real(*args, **kwargs)

    watch._collector.gather = gather


def expected_kind(loss_finite: bool) -> str:
    """The event kind the truth calls for: a rank whose own loss was non-finite is a ``nonfinite-loss``
    (whether fp16 overflow in q_proj reaches the loss depends on the release's attention code); one
    whose loss stayed finite while its gradient did not is a ``nonfinite-grad``."""
    return "nonfinite-grad" if loss_finite else "nonfinite-loss"


def _loop(model, opt, scaler, accelerator, rank: int, scenario: str,
          losses_finite: list[bool], out_dir: str) -> tuple[str | None, int]:
    """The user's loop: fp16 autocast (and a GradScaler) where the scenario needs them. Each step's
    own (pre-reduce) loss finiteness is appended to ``losses_finite``: the tests derive the event kind
    from it rather than from one release's behaviour."""
    from nbguard.errors import NonFiniteError

    steps = 0
    try:
        for batch in _batches(rank, scenario):
            with torch.autocast("cpu", dtype=torch.float16, enabled=scenario in ("forward", "scaler", "uncaught")):
                loss = model(**batch).loss
            losses_finite.append(bool(torch.isfinite(loss.detach()).all()))
            if scenario.startswith("accumulate"):
                accelerator.backward(loss / 2)  # a loop that accumulates without no_sync: DDP reduces each
                if steps % 2 == 1:
                    opt.step()
                    opt.zero_grad(set_to_none=True)  # as accelerate loops write it: the signature is read
                steps += 1
                continue
            if scaler is not None:
                accelerator.backward(scaler.scale(loss))
                scaler.step(opt)
                scaler.update()
            else:
                accelerator.backward(loss)
                opt.step()
            opt.zero_grad(set_to_none=True)  # AcceleratedOptimizer reads the wrapped zero_grad's signature
            steps += 1
    except NonFiniteError as err:
        if scenario == "uncaught":
            # what the test needs to judge the message, then the user's function does not catch it:
            # every rank's process fails
            Path(out_dir, f"losses{rank}.json").write_text(json.dumps(losses_finite))
            raise
        return str(err), steps
    return None, steps


def _gradient_read(watch) -> dict[str, Any]:
    """How the attached watch took this rank's gradients: DDP's buckets, or a hook per parameter."""
    collector = watch._collector
    return {"buckets": collector.bucketed, "parameter_hooks": len(collector.handles)}


def _own_step0_norms(model, batch) -> dict[str, float]:
    """Per group, the norm of this rank's OWN first gradient (a copy of the model, no DDP, no reduce)."""
    import copy

    from nbguard.watcher import group_name

    local = copy.deepcopy(model)
    local(**batch).loss.backward()
    squares: dict[str, float] = {}
    for name, p in local.named_parameters():
        if p.grad is not None:
            squares[group_name(name)] = squares.get(group_name(name), 0.0) + float(p.grad.double().square().sum())
    return {g: v ** 0.5 for g, v in squares.items()}


def train_rank(scenario: str, policy: str, out_dir: str) -> None:
    """The user's training function (runs on every rank)."""
    import torch.distributed as dist
    from accelerate import Accelerator
    from test_host_reads import counting_host_reads
    from watch_helpers import PoisonedSiLU

    from nbguard.testing import plant_fp16_overflow_token, tiny_llama
    from nbguard.watcher import NanWatch, WatchSettings

    scenario, _, mode = scenario.partition("+")  # "fused" / "deferred": the optimizer and read mode
    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    model = tiny_llama()
    if scenario in ("forward", "scaler", "uncaught"):
        plant_fp16_overflow_token(model, HOT_TOKEN)
    if scenario == "backward":
        model.model.layers[1].mlp.act_fn = PoisonedSiLU(armed=rank == 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=bool(mode) or None)
    model, opt = accelerator.prepare(model, opt)
    if scenario == "accumulate-hooks":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        model.register_comm_hook(None, allreduce_hook)  # DDP takes one hook: the watch falls back
    # a modest initial scale: the healthy rank's scaled gradients stay finite, only rank 1 overflows
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8) if scenario == "scaler" else None
    settings = WatchSettings(skip_streak=2) if scenario == "scaler" else None
    if mode == "deferred":
        settings = WatchSettings(read="deferred")
    watched = not (scenario == "rank0only" and rank != 0) and scenario != "unwatched"  # rank0only: rank 0 alone
    own_norms = _own_step0_norms(accelerator.unwrap_model(model), _batches(rank, scenario)[0]) \
        if scenario == "healthy" else {}
    watch = NanWatch(model, optimizer=opt, scaler=scaler, policy=policy, settings=settings)
    if watched:
        watch.attach()
    if scenario == "fail" and rank == 1:
        _break_read(watch)
    started = time.perf_counter()
    reads: dict[str, int] = {}
    reads_landed = 0
    with warnings.catch_warnings(record=True) as caught, (
            counting_host_reads(landed=watch._mirror.holds) if mode == "deferred" else contextlib.nullcontext()) \
            as counter:
        warnings.simplefilter("always")
        losses_finite: list[bool] = []
        stopped, steps = _loop(model, opt, scaler, accelerator, rank, scenario, losses_finite, out_dir)
        if counter is not None:
            reads = dict(counter.nbguard())
            reads_landed = counter.landed
    gradient_read = _gradient_read(watch)
    watch.detach()
    warned = [str(w.message) for w in caught if "not on every rank" in str(w.message) or "read='deferred'" in
              str(w.message)]
    inner = accelerator.unwrap_model(model)
    weights = torch.cat([p.detach().flatten() for p in inner.parameters()])
    result: dict[str, Any] = {
        "rank": rank, "world_size": accelerator.num_processes, "steps": steps, "stopped": stopped,
        "watch_steps": watch.step, "events": [e.to_dict() for e in watch.events], "losses_finite": losses_finite,
        "weights_finite": bool(torch.isfinite(weights).all()),
        "weights_sum": float(weights.double().sum()), "weights_abs_sum": float(weights.double().abs().sum()),
        "exchanges": watch._ranks.exchanges if watch._ranks is not None else 0,
        "streamed": watch._streamer is not None, "watched": watched, "warned": warned,
        "gradient_read": gradient_read, "own_step0_norms": own_norms,
        "history_norms": {g: watch.history.grad_norm(g) for g in watch.history.groups},
        "watch_step0_norms": dict(zip(watch.history.groups, watch.history._norms[0])) if len(watch.history) else {},
        "seconds": time.perf_counter() - started,
        "distributed_type": str(accelerator.distributed_type),
        "read_late": bool(watch._late), "host_reads": reads, "host_reads_landed": reads_landed,
        "skipped": watch.history.skipped_steps,
    }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()  # both ranks finished: nobody left waiting in a collective


def train_trainer_rank(scenario: str, policy: str, out_dir: str) -> None:
    """The HF Trainer (gradient accumulation 2, clipping) under DDP; ``backward`` arms rank 1's
    layer-1 SiLU at optimizer step BAD_STEP only. ``backward+deferred``: read a step late (its default fused AdamW
    skips on the device), the SiLU armed from BAD_STEP on (a replay a step later meets the fault again, as a fault
    of the data or the weights would); ``backward+fused``: the same read on the host."""
    import tempfile

    import torch.distributed as dist
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from watch_helpers import PoisonedSiLU

    import nbguard
    from nbguard.testing import TinyDataset, tiny_llama
    from nbguard.watcher import WatchSettings

    scenario, _, mode = scenario.partition("+")
    torch.set_num_threads(1)
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), max_steps=STEPS, per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, max_grad_norm=1.0, use_cpu=True, report_to=[],
                             save_strategy="no", logging_steps=1, disable_tqdm=True, ddp_backend="gloo")  # (its default optim: adamw_torch_fused)
    rank = args.process_index
    model = tiny_llama()
    act = model.model.layers[1].mlp.act_fn = PoisonedSiLU(armed=False)

    class ArmOnRank1(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            # (+fused/+deferred: armed from BAD_STEP on, so the step judged late still replays armed)
            bad = state.global_step >= BAD_STEP if mode else state.global_step == BAD_STEP
            act.armed = scenario == "backward" and rank == 1 and bad

    micro_losses_finite: list[bool] = []  # this rank's own loss, per micro-batch (before any reduction)
    model.register_forward_hook(lambda m, a, out: micro_losses_finite.append(bool(torch.isfinite(out.loss).all())))
    trainer = Trainer(model=model, args=args, train_dataset=TinyDataset(64), callbacks=[ArmOnRank1()])
    watch = nbguard.watch(trainer, policy=policy, settings=WatchSettings(read="deferred" if mode == "deferred" else "host"))
    trainer.train()
    accumulation = args.gradient_accumulation_steps
    losses_finite = [all(micro_losses_finite[i:i + accumulation])
                     for i in range(0, len(micro_losses_finite), accumulation)]
    gradient_read = _gradient_read(watch)
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    result = {"rank": rank, "world_size": args.world_size, "steps": trainer.state.global_step, "stopped": None,
              "watch_steps": watch.step, "events": [e.to_dict() for e in watch.events], "losses_finite": losses_finite,
              "weights_finite": bool(torch.isfinite(weights).all()), "weights_sum": float(weights.double().sum()),
              "weights_abs_sum": float(weights.double().abs().sum()),
              "exchanges": watch._ranks.exchanges if watch._ranks is not None else 0,
              "gradient_read": gradient_read, "distributed_type": str(trainer.accelerator.distributed_type),
              "read_late": watch._late, "skipped": watch.history.skipped_steps}
    watch.detach()  # the next scenario in this process starts with no watch attached
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()


SPIKE_STEPS = range(6, 9)  # train_rewind_rank: the LR x1e30 on these optimizer steps (both ranks)
REWIND_STEPS = 16


def train_rewind_rank(scenario: str, policy: str, out_dir: str) -> None:
    """An accelerate loop whose LambdaLR puts the LR at 1e27 for SPIKE_STEPS on every rank: the first
    update there makes the weights huge (finite), the next steps' gradients NaN on both ranks. Under
    ``policy="rewind"`` (snapshots every 2 steps) both ranks go back to the same state; records each
    step's loss and the weights after training. ``rewind+deferred``: torch's fused AdamW, read a step late."""
    import torch.distributed as dist
    from accelerate import Accelerator

    import nbguard
    from nbguard.testing import tiny_batch, tiny_llama
    from nbguard.watcher import RewindSettings, WatchSettings

    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    model = tiny_llama()
    deferred = scenario.endswith("+deferred")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=deferred or None)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1e30 if s in SPIKE_STEPS else 1.0)
    model, opt = accelerator.prepare(model, opt)
    watch = nbguard.watch(model, optimizer=opt, scheduler=sched, policy=policy, verify=False,
                          rewind=RewindSettings(every=2), settings=WatchSettings(read="deferred" if deferred else "host"))
    losses: list[float] = []
    for step in range(REWIND_STEPS):
        loss = model(**tiny_batch(2, 12, seed=100 * rank + step % 4)).loss
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        losses.append(float(loss.detach()))
    watch.detach()
    weights = torch.cat([p.detach().flatten() for p in accelerator.unwrap_model(model).parameters()])
    result = {"rank": rank, "losses": losses, "events": [e.to_dict() for e in watch.events], "read_late": watch._late,
              "rewinds": watch.rewinds, "policy": watch.policy, "weights_finite": bool(torch.isfinite(weights).all()),
              "weights_sum": float(weights.double().sum()), "weights_abs_sum": float(weights.double().abs().sum())}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()


UNEVEN_STEPS = 3


def uneven_batch(rank: int, step: int) -> dict[str, torch.Tensor]:
    """Rank 0's rows are supervised everywhere; rank 1's only on their last 2 tokens (a prompt-masked
    pipeline whose answers are short): 22 supervised tokens against 4."""
    from nbguard.testing import tiny_batch

    batch = tiny_batch(2, 12, seed=100 * rank + step)
    if rank == 1:
        batch["labels"][:, :-2] = -100
    return batch


def train_uneven_rank(scenario: str, policy: str, out_dir: str) -> None:
    """Uneven supervised tokens per rank in an accelerate loop. ``uneven``: each rank's loss is its own
    token mean (the default); ``normalised``: the loop divides by every rank's tokens (num_items_in_batch,
    all-reduced) and multiplies by the world size, as the Trainer's average_tokens_across_devices does.
    Records the first step's averaged gradient (lm_head), for a comparison with one process over both
    ranks' rows."""
    import torch.distributed as dist
    from accelerate import Accelerator

    import nbguard
    from nbguard.testing import tiny_llama

    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    model = tiny_llama()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, opt = accelerator.prepare(model, opt)
    watch = nbguard.watch(model, optimizer=opt, policy=policy, verify=False)
    first_grad: list[float] = []
    for step in range(UNEVEN_STEPS):
        batch = uneven_batch(rank, step)
        if scenario == "normalised":
            count = (batch["labels"][:, 1:] != -100).sum().reshape(1)
            dist.all_reduce(count)
            loss = model(**batch, num_items_in_batch=count).loss * accelerator.num_processes
        else:
            loss = model(**batch).loss
        accelerator.backward(loss)
        if step == 0:
            first_grad = accelerator.unwrap_model(model).lm_head.weight.grad.flatten().tolist()
        opt.step()
        opt.zero_grad(set_to_none=True)
    watch.detach()
    result = {"rank": rank, "events": [e.to_dict() for e in watch.events], "first_grad": first_grad}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()


def train_fsdp_rank(scenario: str, policy: str, out_dir: str) -> None:
    """FSDP2 (``fully_shard`` per decoder layer and the root) in a plain loop; records, per step,
    each group's norm of the WHOLE averaged gradient (gathered with ``full_tensor``) next to the
    watch's, which come from the shards. ``backward-unread``: as ``backward``, on a torch whose FSDP
    internals the pre-reduce read needs are absent (made to raise here): the watch reads as before."""
    import torch.distributed as dist

    from nbguard.testing import tiny_llama
    from nbguard.watcher.distributed import fsdp_grads

    torch.set_num_threads(1)
    if not dist.is_initialized():  # a scenario before this one in the launch may have started the group
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = tiny_llama()
    real_fsdp_params = fsdp_grads.fsdp_params
    if scenario == "backward-unread":
        def absent(model):
            raise AttributeError("'FSDPState' object has no attribute '_fsdp_param_groups'")

        fsdp_grads.fsdp_params = absent
    try:
        _train_fsdp(model, rank, scenario, policy, out_dir)
    finally:
        fsdp_grads.fsdp_params = real_fsdp_params  # the next scenario reads FSDP's internals again


def _train_fsdp(model, rank: int, scenario: str, policy: str, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import nbguard
    from nbguard.errors import NonFiniteError
    from nbguard.watcher import group_name

    if scenario.startswith("backward"):
        from watch_helpers import PoisonedSiLU

        model.model.layers[1].mlp.act_fn = PoisonedSiLU(armed=rank == 1)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        watch = nbguard.watch(model, optimizer=opt, policy=policy)
    pre_reduce = watch._ranks.pre_reduce
    reference: list[dict[str, float]] = []
    stopped, steps = None, 0
    losses_finite: list[bool] = []
    try:
        for batch in _batches(rank, scenario):
            loss = model(**batch).loss
            losses_finite.append(bool(torch.isfinite(loss.detach()).all()))
            loss.backward()
            sq: dict[str, float] = {}
            for name, p in model.named_parameters():
                full = p.grad.full_tensor()  # a collective on every rank, outside the watch
                sq[group_name(name)] = sq.get(group_name(name), 0.0) + float(full.double().square().sum())
            reference.append({g: v ** 0.5 for g, v in sq.items()})
            opt.step()
            opt.zero_grad()
            steps += 1
    except NonFiniteError as err:
        stopped = str(err)
    watch.detach()
    full = torch.cat([p.detach().full_tensor().flatten() for p in model.parameters()])
    result = {"rank": rank, "world_size": dist.get_world_size(), "steps": steps, "stopped": stopped,
              "watch_steps": watch.step, "events": [e.to_dict() for e in watch.events], "losses_finite": losses_finite,
              "groups": watch.history.groups,
              "watch_norms": {g: watch.history.grad_norm(g) for g in watch.history.groups},
              "reference_norms": reference, "sharded": watch._ranks.sharded,
              "pre_reduce": {"available": pre_reduce.available, "missing": pre_reduce.missing},
              "warned": [str(w.message) for w in caught if "nbguard" in str(w.message)],
              "weights_finite": bool(torch.isfinite(full).all()), "weights_sum": float(full.double().sum()),
              "distributed_type": "FSDP2"}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()


# Launcher failures that are the machine's, not the run's: a port taken in between by another test
# run, and a rare abort of a c10d/gloo thread while the interpreter exits (seen about once in twenty
# torchrun launches here, after every rank had written its results). The whole run is done again;
# the second run must pass on its own.
INFRASTRUCTURE_FAILURES = ("address already in use", "terminate called without an active exception")


def _run(make_cmd: Callable[[int], list[str]], stall: float,
         prepare: Callable[[], None] | None = None) -> subprocess.CompletedProcess:
    """Run the launcher on a free port; once more if it failed for one of INFRASTRUCTURE_FAILURES.

    ``stall``: how long the launch may make no progress at all before it counts as hung (``_run_once``).
    ``prepare``: called before each attempt (a batch clears its scenarios' folders: a retry starts fresh)."""
    for _attempt in range(2):
        if prepare is not None:
            prepare()
        done = _run_once(make_cmd(free_port()), stall)
        if done.returncode == 0 or not any(text in done.stdout.lower() for text in INFRASTRUCTURE_FAILURES):
            break
    return done


# A hang is a launch whose processes stop using the CPU: ranks waiting in a collective for a peer that
# will not come sleep in the kernel. A run that is only slow (both cores busy with other work: burners, a
# second lane) keeps using what CPU it gets. So the guard judges progress, not wall time: it fails the test
# once the launch's processes together used less than STALL_CPU_SECONDS of CPU over ``stall`` seconds, and
# stops a launch that still runs after HARD_LIMIT_FACTOR times ``stall`` whatever it does.
STALL_CPU_SECONDS = 1.0
HARD_LIMIT_FACTOR = 6
POLL_SECONDS = 5.0


def tree_cpu_seconds(root: psutil.Process) -> float:
    """CPU time (user + system) used so far by ``root`` and every process under it that is alive."""
    total = 0.0
    for process in (root, *root.children(recursive=True)):
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            times = process.cpu_times()
            total += times.user + times.system
    return total


def _run_once(cmd: list[str], stall: float) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "tests"), env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONFAULTHANDLER"] = "1"  # a rank that gets SIGABRT prints every thread's stack first
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    root = psutil.Process(proc.pid)
    started = last_progress = time.monotonic()
    used = 0.0
    while True:
        try:
            out, _ = proc.communicate(timeout=POLL_SECONDS)  # (a retry after a timeout loses no output)
            return subprocess.CompletedProcess(cmd, proc.returncode, out, None)
        except subprocess.TimeoutExpired:
            pass
        now = time.monotonic()
        with contextlib.suppress(psutil.NoSuchProcess):
            cpu = tree_cpu_seconds(root)
            if cpu - used >= STALL_CPU_SECONDS:
                used, last_progress = cpu, now
        stalled = now - last_progress > stall
        if stalled or now - started > HARD_LIMIT_FACTOR * stall:
            break
    _stop_tree(proc.pid)
    out, _ = proc.communicate(timeout=60)
    why = (f"its processes used under {STALL_CPU_SECONDS:.0f} s of CPU in {stall:.0f} s" if stalled
           else f"still running after {now - started:.0f} s")
    raise AssertionError(f"the two-rank run hung ({why}; killed):\n{out[-12000:]}") from None


def _stop_tree(pid: int) -> None:
    """Stop a launcher and every process under it. torchrun starts each rank in a session of its own
    (so a process-group kill misses them, and they keep the output pipe open): walk the tree instead.
    The ranks get SIGABRT first, so the output shows where each one hung."""
    launcher = psutil.Process(pid)
    tree = [launcher, *launcher.children(recursive=True)]
    for process in tree[1:]:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.send_signal(signal.SIGABRT)
    psutil.wait_procs(tree[1:], timeout=10)
    for process in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(tree, timeout=10)


def read_ranks(out_dir: Path, world_size: int = 2) -> list[dict[str, Any]]:
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world_size)]


def launch_notebook(scenario: str, policy: str, out_dir: Path, stall: float = 150,
                    trainer: bool = False, fn: str | None = None) -> subprocess.CompletedProcess:
    """accelerate.notebook_launcher(train_rank, num_processes=2): forked workers, DDP over gloo
    (``fn``: another training function of this file)."""
    fn = fn or ("train_trainer_rank" if trainer else "train_rank")
    def cmd(port: int) -> list[str]:
        return [sys.executable, "-c", f"from accelerate import notebook_launcher; from ddp_helpers import {fn}; "
                f"notebook_launcher({fn}, args=({scenario!r}, {policy!r}, {str(out_dir)!r}), num_processes=2, "
                f"use_port='{port}')"]

    return _run(cmd, stall)


def launch_streamed(scenario: str, policy: str, out_dir: Path, stall: float = 150) -> subprocess.CompletedProcess:
    """notebook_launcher with the kernel side open, as ``%%nanwatch`` opens it: the parent process
    writes what it received from the forked ranks to ``out_dir/parent.json``."""
    def cmd(port: int) -> list[str]:
        return [sys.executable, "-c", f"""
import json, nbguard
from accelerate import notebook_launcher
from ddp_helpers import train_rank
from nbguard.notebook.ranks import RankWatches
seen = []
watches = RankWatches().open()
watches.add_listener(lambda w, kind, payload: seen.append([kind, payload.get("rank") if isinstance(payload, dict)
                                                                 else payload.rank]))
notebook_launcher(train_rank, args=({scenario!r}, {policy!r}, {str(out_dir)!r}), num_processes=2,
                  use_port='{port}')
watches.detach()
json.dump({{"document": watches.to_document(), "rows": watches.rank_rows(), "seen": seen,
           "report": nbguard.report().to_dict(), "stream_errors": watches.channel.errors}},
          open({str(out_dir / "parent.json")!r}, "w"))
"""]

    return _run(cmd, stall)


def launch_torchrun(scenario: str, policy: str, out_dir: Path, stall: float = 150,
                    trainer: bool = False, fsdp: bool = False) -> subprocess.CompletedProcess:
    """torchrun --nproc_per_node 2 on this file: separate (not forked) processes."""
    entry = "trainer" if trainer else "fsdp" if fsdp else "loop"
    return _run(lambda port: [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                              "127.0.0.1", "--master_port", str(port), __file__, entry, scenario, policy, str(out_dir)],
                stall)


# --- several scenarios per launch -------------------------------------------------------------------

def train_checkpoint_rank(scenario: str, policy: str, out_dir: str) -> None:
    """tests/ddp_checkpoint_ranks.py's run: LoRA + activation checkpointing (``scenario``: "reentrant" or
    "non-reentrant") under DDP(find_unused_parameters=True); no watch (``policy`` unused)."""
    from ddp_checkpoint_ranks import main

    torch.set_num_threads(1)
    main(scenario, out_dir)


SCENARIO_FUNCTIONS = {f.__name__: f for f in (train_rank, train_trainer_rank, train_rewind_rank, train_uneven_rank,
                                              train_fsdp_rank, train_checkpoint_rank)}
Scenario = tuple[str, str, str]  # (training function, scenario, policy)

# The shared launches (``shared_batch``), each scenario a test (or several) reads. The Trainer goes after
# the loops (its TrainingArguments reset accelerate's shared state). ``rank0only`` goes second, before every
# scenario that watches on both ranks: when the ranks paired their watches by count, its rank 1 attached
# none, so the next watch on every rank paired rank 0's with rank 1's previous one and waited for a peer that
# never joined (``fail`` hung after it). They pair by where they attach among the collectives now.
NOTEBOOK_BATCH: list[Scenario] = [
    ("train_rank", "healthy", "warn"), ("train_rank", "rank0only", "warn"), ("train_rank", "unwatched", "warn"),
    ("train_rank", "accumulate", "warn"), ("train_rank", "accumulate-hooks", "warn"),
    ("train_rank", "forward", "skip"), ("train_rank", "forward", "warn"), ("train_rank", "forward", "stop"),
    ("train_rank", "backward", "skip"), ("train_rank", "loss", "skip"), ("train_rank", "scaler", "warn"),
    ("train_rank", "fail", "warn"),
    # read="deferred" across ranks (test_ddp_deferred.py), each beside its host-mode twin on the same fused AdamW
    ("train_rank", "unwatched+fused", "skip"), ("train_rank", "healthy+fused", "skip"),
    ("train_rank", "healthy+deferred", "skip"), ("train_rank", "backward+fused", "skip"),
    ("train_rank", "backward+deferred", "skip"), ("train_rank", "loss+fused", "skip"),
    ("train_rank", "loss+deferred", "skip"), ("train_rank", "loss+deferred", "stop"),
    ("train_rank", "fail+deferred", "warn"), ("train_rank", "accumulate-hooks+deferred", "skip"),
    ("train_rewind_rank", "rewind", "rewind"), ("train_rewind_rank", "rewind+deferred", "rewind"),
    ("train_uneven_rank", "uneven", "warn"), ("train_uneven_rank", "normalised", "warn"),
    ("train_trainer_rank", "backward", "stop"),
    ("train_trainer_rank", "backward+fused", "skip"), ("train_trainer_rank", "backward+deferred", "skip"),
]
TORCHRUN_BATCH: list[Scenario] = [
    ("train_rank", "healthy", "warn"), ("train_rank", "forward", "skip"), ("train_rank", "forward", "stop"),
    ("train_rank", "backward", "skip"), ("train_rank", "loss", "skip"),
    ("train_fsdp_rank", "healthy", "skip"), ("train_fsdp_rank", "loss", "skip"),
    ("train_fsdp_rank", "backward", "skip"), ("train_fsdp_rank", "backward-unread", "skip"),
    ("train_trainer_rank", "backward", "skip"),
]

# tests/test_rules_ddp_checkpointing.py: both modes in one torchrun launch of their own (the reentrant one
# leaves its DDP reducer failed mid-backward; the other scenarios need not share a process with that)
CHECKPOINT_BATCH: list[Scenario] = [("train_checkpoint_rank", "reentrant", "-"),
                                    ("train_checkpoint_rank", "non-reentrant", "-")]


def scenario_dir(fn: str, scenario: str, policy: str) -> str:
    return f"{fn}-{scenario}-{policy}"


def _rank() -> int:
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))


def assert_clean(where: str) -> None:
    """No watch attached in this process, torch's clipping functions its own: what a scenario starts from
    (and what every detach must leave)."""
    from nbguard.watcher.core.watch import attached_watches

    attached = attached_watches()
    assert not attached, f"{where}: watches still attached: {attached}"
    patched = [f"{module.__name__}.{name}" for (module, name), original in _CLIP_FUNCTIONS.items()
               if getattr(module, name, None) is not original]
    assert not patched, f"{where}: torch's functions still patched: {patched}"


def run_scenarios(scenarios: list[Scenario], out_dir: str) -> None:
    """Every rank's function for a batch: each scenario in turn, in ``out_dir/<scenario_dir>``, checked clean
    before it starts (and after the last). A scenario that raises leaves its traceback in its folder
    (``error{rank}.txt``) and ends the launch: its peer may wait in a collective it will never join."""
    rank = _rank()
    previous = "the launch's start"
    for fn, scenario, policy in scenarios:
        name = scenario_dir(fn, scenario, policy)
        sub = Path(out_dir, name)
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"started{rank}").write_text("")
        try:
            assert_clean(f"before {name} (after {previous})")
            SCENARIO_FUNCTIONS[fn](scenario, policy, str(sub))
        except BaseException:
            (sub / f"error{rank}.txt").write_text(traceback.format_exc())
            raise
        previous = name
    try:
        assert_clean(f"after {previous}, the last scenario")
    except BaseException:
        (Path(out_dir, previous) / f"error{rank}.txt").write_text(traceback.format_exc())
        raise


def _batch_cmd(launcher: str, scenarios: list[Scenario], out_dir: Path) -> Callable[[int], list[str]]:
    todo = json.dumps([list(s) for s in scenarios])
    if launcher == "notebook_launcher":  # forked workers, as in a notebook
        return lambda port: [sys.executable, "-c", "from accelerate import notebook_launcher; "
                             f"from ddp_helpers import run_scenarios; notebook_launcher(run_scenarios, "
                             f"args=({json.loads(todo)!r}, {str(out_dir)!r}), num_processes=2, use_port='{port}')"]
    assert launcher == "torchrun", launcher
    return lambda port: [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                         "127.0.0.1", "--master_port", str(port), __file__, "batch", todo, str(out_dir)]


def _finished(sub: Path, world_size: int = 2) -> bool:
    return not list(sub.glob("error*.txt")) and all((sub / f"rank{r}.json").exists() for r in range(world_size))


def launch_batch(launcher: str, scenarios: list[Scenario], out_dir: Path, stall: float = 150) -> Batch:
    """Run ``scenarios`` in as few launches as they allow: one, unless a scenario fails; then the ones after it
    go to a new launch. Each launch (its scenarios, exit status, output, and the scenario that ended it) is
    written to ``out_dir/launches.json``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    launches: list[dict[str, Any]] = []
    todo = list(scenarios)
    while todo:
        names = [scenario_dir(*s) for s in todo]

        def fresh(names=names) -> None:
            for name in names:
                shutil.rmtree(out_dir / name, ignore_errors=True)

        try:
            done = _run(_batch_cmd(launcher, todo, out_dir), stall, prepare=fresh)
            code, output = done.returncode, done.stdout
        except AssertionError as hung:  # the guard stopped a launch that stopped using the CPU
            code, output = None, str(hung)
        started = [s for s, name in zip(todo, names) if (out_dir / name).exists()]
        culprit = next((s for s in started if not _finished(out_dir / scenario_dir(*s))), None)
        launches.append({"scenarios": names, "returncode": code, "output": output[-12000:],
                         "ended_by": scenario_dir(*culprit) if culprit else None})
        if code == 0 or culprit is None:
            break  # done, or failed outside any scenario (each test of the launch shows its output)
        todo = todo[todo.index(culprit) + 1:]
    (out_dir / "launches.json").write_text(json.dumps(launches))
    return Batch(out_dir)


class Batch:
    """The results of a ``launch_batch``, read back from its folder (by any xdist worker)."""

    def __init__(self, out_dir: Path):
        self.out_dir = out_dir
        self.launches = json.loads((out_dir / "launches.json").read_text())

    def ranks(self, scenario: str, policy: str, fn: str = "train_rank", world_size: int = 2) -> list[dict[str, Any]]:
        """Each rank's result of one scenario; its own failure (with its traceback and its launch's output)
        if it raised, left no result, or its launch failed with no scenario to blame."""
        name = scenario_dir(fn, scenario, policy)
        launch = next((x for x in reversed(self.launches) if name in x["scenarios"]), None)
        assert launch is not None, f"{name} is not in this batch: {[x['scenarios'] for x in self.launches]}"
        sub = self.out_dir / name
        errors = "".join(f"--- {p.name} ---\n{p.read_text()}" for p in sorted(sub.glob("error*.txt")))
        code = launch["returncode"]
        how = (f"launch {'stopped as hung' if code is None else f'exit {code}'}, "
               f"ended by {launch['ended_by'] or 'no scenario'}")
        if errors or launch["ended_by"] == name:
            raise AssertionError(f"scenario {name} failed; {how}:\n{errors}\n--- launch output ---\n"
                                 f"{launch['output'][-6000:]}")
        if not _finished(sub, world_size) or (launch["returncode"] != 0 and launch["ended_by"] is None):
            raise AssertionError(f"scenario {name} left no result; {how}:\n{launch['output'][-6000:]}")
        return read_ranks(sub, world_size)


def shared_root(tmp_path_factory) -> Path:
    """A folder of this pytest run that every xdist worker sees (the workers' base temp's parent)."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "multirank-batches"
    root.mkdir(exist_ok=True)
    return root


def shared_batch(tmp_path_factory, name: str, launcher: str, scenarios: list[Scenario],
                 stall: float = 150) -> Batch:
    """One launch of ``scenarios`` per pytest run: the first test (on whichever worker) to ask launches it,
    the others wait for it (a file lock) and read its results."""
    from filelock import FileLock

    root = shared_root(tmp_path_factory)
    out_dir = root / name
    with FileLock(str(root / f"{name}.lock")):
        if not (out_dir / "launches.json").exists():
            launch_batch(launcher, scenarios, out_dir, stall)
    return Batch(out_dir)


def notebook_batch(tmp_path_factory) -> Batch:
    return shared_batch(tmp_path_factory, "notebook", "notebook_launcher", NOTEBOOK_BATCH)


def torchrun_batch(tmp_path_factory) -> Batch:
    return shared_batch(tmp_path_factory, "torchrun", "torchrun", TORCHRUN_BATCH)


def batch_ranks(tmp_path_factory, launcher: str, scenario: str, policy: str,
                fn: str = "train_rank") -> list[dict[str, Any]]:
    """One scenario's ranks from this pytest run's shared launch for ``launcher`` (launched on first use)."""
    batch = notebook_batch if launcher == "notebook_launcher" else torchrun_batch
    return batch(tmp_path_factory).ranks(scenario, policy, fn)


def _main_batch(scenarios_json: str, out_dir: str) -> None:
    """torchrun's entry for a batch: the scenarios, then every rank leaves the group together."""
    import torch.distributed as dist

    run_scenarios([tuple(s) for s in json.loads(scenarios_json)], out_dir)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


ENTRIES = {"loop": train_rank, "trainer": train_trainer_rank, "fsdp": train_fsdp_rank}

if __name__ == "__main__":
    if sys.argv[1] == "batch":
        _main_batch(sys.argv[2], sys.argv[3])
    else:
        ENTRIES[sys.argv[1]](*sys.argv[2:5])
