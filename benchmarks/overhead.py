"""Step-time overhead of nbguard's watch (also with its activation probe) against no watch, anomaly mode and
DebugUnderflowOverflow.

A Llama-shaped model (~21M parameters by default) trains on CPU with AdamW. Each variant has its own
copy of the model and optimizer; the variants run interleaved, one step each per round, in a rotating
order, so drift on a shared machine hits them all alike. Reported: median step time, the median of
the per-round ratios against the baseline, then how quickly a planted fault is localised.

    OMP_NUM_THREADS=1 python benchmarks/overhead.py --rounds 20

``--fixed-cost`` measures the watch's fixed cost per step instead, where steps are short: a 4-layer
tiny Llama and a 24-layer tiny Llama with LoRA adapters (PEFT), each step clipping like the Trainer
(``clip_grad_norm_(1.0)``). Variants: no watch, the watch with a hook per parameter (the path kept
for DDP/FSDP/DeepSpeed, and the only one before the fused read), the watch's fused read, and the watch
with its gradient norms switched off (what is left: the part that does not grow with the tensors). Reported:
the median per-round ratio against no watch and the added time per trainable tensor per step.

    OMP_NUM_THREADS=1 python benchmarks/overhead.py --fixed-cost --rounds 60 --clock cpu --threads 1

``--hook-times`` says where that fixed part goes on the tiny Llama: the time inside each of the four
step hooks, the watch with its detectors removed, a copy doing only the irreducible work of a step
(the yardstick for the watch's own Python), and the cold first op of a step.

    OMP_NUM_THREADS=1 python benchmarks/overhead.py --hook-times --rounds 100 --clock cpu --threads 1

``--slope`` separates what grows with the trainable tensors from what does not: the same LoRA model on
6, 12 and 24 layers, the added time per step against no watch, and its slope per tensor.

    OMP_NUM_THREADS=1 python benchmarks/overhead.py --slope --rounds 60 --clock cpu --threads 1

``--paired`` attaches and detaches the watch in turns on one copy of each model instead: no spread
between model copies in the ratio. ``--copy-spread`` measures that spread: unwatched copies against
the first.

    OMP_NUM_THREADS=1 python benchmarks/overhead.py --paired --rounds 150 --clock cpu --threads 1
    OMP_NUM_THREADS=1 python benchmarks/overhead.py --copy-spread --rounds 80 --clock cpu --threads 1

``--against TREE`` (repeatable) adds the watch of another checkout (``git worktree add /tmp/prev 1049326``,
or ``git archive 1049326 nbguard | tar -x -C /tmp/prev``) to the same rounds, in the default mode and in
``--fixed-cost``: a before/after under the same load, where separate runs on a shared machine differ by
more than the change. ``--against-rev REV`` does the export itself (a commit of this repository, e.g. the
previous release). ``--update-norms-off`` adds this tree's watch without its update norms.

    OMP_NUM_THREADS=1 python benchmarks/overhead.py --layers 2 --rounds 30 --clock cpu --threads 1 --against /tmp/prev

In the default mode each watch is made by its tree's ``nbguard.watch(model, optimizer=opt)``: every default of
the public entry point. No flag turns a default of the watch off: ``--skip-activations`` leaves out the extra
variant with the activation probe (off by default), ``--watch-only`` / ``--skip-debug`` the anomaly-mode and
DebugUnderflowOverflow variants, ``--skip-localise`` the planted-NaN run after the rounds.
"""
from __future__ import annotations

import argparse
import copy
import math
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nbguard.watcher import NanWatch  # noqa: E402

# "cpu" counts this thread's CPU time only: on a shared machine it ignores time spent descheduled
# (valid with one intra-op thread on CPU, where all the work runs on the calling thread).
CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


def build_model(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
                         num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=8,
                         max_position_embeddings=args.seq_len, attn_implementation="sdpa")
    return LlamaForCausalLM(config).to(args.device)


def make_batch(args, seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, args.vocab, (args.batch_size, args.seq_len), generator=gen).to(args.device)
    return {"input_ids": ids, "labels": ids.clone()}


def synchronize(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class Variant:
    def __init__(self, name, model, args, watch_class=None):
        self.name = name
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=args.fused or None)
        self.times: list[float] = []
        self.extra = None
        if name == UPDATE_NORMS_OFF:
            from nbguard.watcher import WatchSettings

            self.extra = NanWatch(model, optimizer=self.opt, settings=WatchSettings(update_norms=False)).attach()
        elif name == READ_DEFERRED:
            self.extra = deferred_watch(model, self.opt)
        elif name.startswith("nbguard watch"):
            # nbguard.watch itself (this tree's, or another checkout's): every default of the public entry point
            watch = watch_class or default_watch()
            self.extra = watch(model, optimizer=self.opt, activations=name.endswith("+ activations"))
        elif name == "DebugUnderflowOverflow":
            from transformers.debug_utils import DebugUnderflowOverflow

            self.extra = DebugUnderflowOverflow(model)  # its hooks stay for the model's life

    def step(self, batch, device, clock=time.perf_counter):
        anomaly = self.name == "detect_anomaly"
        synchronize(device)
        start = clock()
        with torch.autograd.set_detect_anomaly(anomaly):
            loss = self.model(**batch).loss
            loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        synchronize(device)
        return clock() - start


UPDATE_NORMS_OFF = "nbguard watch, update norms off"


def default_watch():
    """This tree's ``nbguard.watch`` (imported late: the other trees' copies are imported first)."""
    from nbguard.api import watch

    return watch
READ_DEFERRED = "nbguard watch, read deferred"  # WatchSettings(read="deferred"): no host wait per step (issue 45)


def deferred_watch(model, optimizer):
    """The watch reading a step late; under skip a fused optimizer drops a bad update on the device (with another
    optimizer the watch says so once and reads on the host: run with --fused)."""
    from nbguard.watcher import WatchSettings

    return NanWatch(model, optimizer=optimizer, policy="skip", settings=WatchSettings(read="deferred")).attach()


def measure(args):
    # other checkouts' watches first: their clip taps then sit inside this tree's (see other_tree_watch)
    others = {f"nbguard watch, {label}": other_tree_watch(tree, "api").watch for label, tree in against_trees(args)}
    base = build_model(args)
    n_params = sum(p.numel() for p in base.parameters())
    names = ["baseline", "nbguard watch", "nbguard watch + activations", "detect_anomaly", "DebugUnderflowOverflow"]
    if args.skip_debug:
        names.remove("DebugUnderflowOverflow")
    if args.watch_only:  # a tighter estimate of the watch alone: more rounds in the same time
        names = names[:3]
    if args.skip_activations:
        names.remove("nbguard watch + activations")
    if args.update_norms_off:
        names.insert(2, UPDATE_NORMS_OFF)
    if args.read_deferred:
        names.insert(2, READ_DEFERRED)
    names += others  # attached last
    # every variant is a copy (the baseline too): the same kind of allocation, none favoured
    variants = [Variant(n, copy.deepcopy(base), args, others.get(n)) for n in names]
    batches = [make_batch(args, s) for s in range(4)]
    for v in variants:  # warm-up: allocator, autograd caches, first AdamW state
        for w in range(args.warmup):
            v.step(batches[w % len(batches)], args.device)
    ratios = {v.name: [] for v in variants}
    for r in range(args.rounds):
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        this_round = {}
        for v in order:
            this_round[v.name] = v.step(batches[r % len(batches)], args.device, CLOCKS[args.clock])
            v.times.append(this_round[v.name])
        for v in variants:
            ratios[v.name].append(this_round[v.name] / this_round["baseline"])
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{k} {t * 1e3:.0f} ms" for k, t in this_round.items()),
              file=sys.stderr)
    for v in variants:
        if v.name.startswith("nbguard watch"):
            assert v.extra.events == [], v.extra.summary()  # a healthy run raises no alarm
            v.extra.detach()
    return n_params, variants, ratios


def localise(args):
    """Plant a NaN into one weight at step ``k``; report the step it was named in and the replay cost."""
    model = build_model(args)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    target = f"model.layers.{args.layers // 2}.mlp.down_proj"
    fault_step = 3
    watch = NanWatch(model, optimizer=opt).attach()
    step_times = []
    for step in range(fault_step + 2):
        if step == fault_step:
            with torch.no_grad():
                model.get_submodule(target).weight[0, 0] = float("nan")
        start = time.perf_counter()
        model(**make_batch(args, step)).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        step_times.append(time.perf_counter() - start)
        if watch.events:
            break
    watch.detach()
    anomaly_says = None
    with torch.autograd.set_detect_anomaly(True):  # what anomaly mode reports for the same fault
        try:
            model(**make_batch(args, fault_step)).loss.backward()
        except RuntimeError as exc:
            anomaly_says = str(exc).splitlines()[0]
    opt.zero_grad(set_to_none=True)
    event = watch.events[0]
    origin = event.origins[0] if event.origins else None
    return {
        "target": target,
        "named": origin.module if origin else None,
        "cause": event.cause,
        "steps_to_localise": event.step - fault_step,
        "replay_s": event.evidence.get("replay_seconds"),
        "step_s": statistics.median(step_times[:fault_step]),
        "anomaly_says": anomaly_says,
    }


def tiny_llama(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64))


def tiny_lora(layers: int):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    return get_peft_model(tiny_llama(layers), config)


def tiny_batch(seed: int = 0, device: str = "cpu") -> dict[str, torch.Tensor]:
    """The fixed-cost modes' batch: 4 rows of 32 random token ids of the tiny models' 256, labels the same."""
    ids = torch.randint(1, 256, (4, 32), generator=torch.Generator().manual_seed(seed)).to(device)
    return {"input_ids": ids, "labels": ids.clone()}


def against_trees(args) -> list[tuple[str, str]]:
    """(label, folder) of each checkout to compare with: ``--against TREE`` as given, ``--against-rev REV``
    exported from this repository with ``git archive`` into a temporary folder (only ``nbguard/`` is needed)."""
    import subprocess
    import tempfile

    trees = [(tree, tree) for tree in args.against]
    repo = Path(__file__).resolve().parents[1]
    for rev in args.against_rev:
        commit = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", rev], check=True,
                                capture_output=True, text=True).stdout.strip()
        folder = tempfile.mkdtemp(prefix=f"nbguard-{commit}-")
        archive = subprocess.run(["git", "-C", str(repo), "archive", commit, "nbguard"], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", folder], input=archive, check=True)
        trees.append((commit if commit.startswith(rev) else f"{rev} ({commit})", folder))
    return trees


def other_tree_watch(tree: str, module: str = "watcher"):
    """``NanWatch`` from another checkout's ``nbguard`` (e.g. main, for a before/after in one process); with
    ``module="api"``, that checkout's ``nbguard.api`` module (its public ``watch``).

    Each tree is copied as its own package (``nbguard_other``, ``nbguard_other1``, ...) with its own
    clip-tap mark, so the taps stack: attach this tree's watches first (its tap then wraps torch's own
    ``clip_grad_norm_``), the other trees' last (their wrappers sit outside and call through). Every
    variant pays every wrapper.
    """
    import importlib
    import shutil
    import tempfile

    name = f"nbguard_other{len(_OTHER_TREES) or ''}"
    target = Path(tempfile.mkdtemp()) / name
    shutil.copytree(Path(tree) / "nbguard", target)
    for tap in target.glob("watcher/**/clip_tap.py"):  # (watcher/clip_tap.py before 95777ff, reads/ since)
        tap.write_text(tap.read_text().replace("__nbguard_clip_tap__", f"__{name}_clip_tap__"))
    sys.path.insert(0, str(target.parent))
    _OTHER_TREES.append(tree)
    package = importlib.import_module(f"{name}.{module}")
    return package.NanWatch if module == "watcher" else package


_OTHER_TREES: list[str] = []


class FixedCostVariant:
    """One copy of the model trained like the Trainer does: fwd, bwd, clip to 1.0, AdamW step."""

    def __init__(self, name: str, model: torch.nn.Module, watch_class=None, fused: bool = False):
        self.name = name
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=1e-5, fused=fused or None)
        self.watch = None
        if name == READ_DEFERRED_FIXED:
            self.watch = deferred_watch(model, self.opt)
        elif name != "no watch":
            self.watch = (watch_class or NanWatch)(model, optimizer=self.opt)
            self.watch._collector.per_parameter = name.startswith("hook per parameter")
            self.watch.attach()
            # everything but the gradient read (capture, detectors, the step's read): the part of the
            # fixed cost that does not grow with the number of tensors
            self.watch._collector.enabled = not name.startswith("no gradient read")

    def clip(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def run(self, batch, steps: int, clock, device: str = "cpu", loss_item: bool = False) -> float:
        synchronize(device)
        start = clock()
        for _ in range(steps):
            loss = self.model(**batch).loss
            loss.backward()
            self.clip(self.params, 1.0)
            self.opt.step()
            self.after_step()
            self.opt.zero_grad(set_to_none=True)
            if loss_item:  # as the Trainer's NaN filter and a progress bar's loss do: one host read per step
                loss.item()
        synchronize(device)  # a GPU's queued work counts in the step that queued it
        return (clock() - start) / steps

    def after_step(self) -> None:
        """Work a variant does between the optimizer's step and zero_grad (none here)."""


READ_DEFERRED_FIXED = "fused read, a step late (skip on the device)"

# steps profiled per variant: a multiple of the watch's weight-fingerprint period (frozen_check_every),
# so its periodic work counts at its real share
PROFILED_STEPS = 10


def launches(variant: FixedCostVariant, batch, steps: int, device: str, loss_item: bool) -> tuple[dict, Counter]:
    """Per step, from torch's profiler: device kernels (on CUDA), aten ops at every level, and host
    waits on the device (``cudaStreamSynchronize`` / ``cudaDeviceSynchronize``: each one drains the
    queue); and the aten ops by name (to list what a variant adds)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with profile(activities=activities) as prof:
        variant.run(batch, steps, time.perf_counter, device, loss_item)
    events = prof.events()
    kernels = sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    ops = Counter(e.name for e in events if e.name.startswith("aten::"))
    syncs = sum(1 for e in events if e.name in ("cudaStreamSynchronize", "cudaDeviceSynchronize"))
    return {"kernels": kernels / steps, "aten ops": ops.total() / steps, "host waits": syncs / steps}, ops


def fixed_cost(args) -> None:
    clock = CLOCKS[args.clock]
    others = {label: other_tree_watch(tree) for label, tree in against_trees(args)}
    batch = tiny_batch(device=args.device)
    where = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else f"CPU, {torch.get_num_threads()} threads"
    print(f"\n### the watch's fixed cost ({where}, {args.rounds} rounds of {args.steps_per_round} steps, "
          f"{args.clock} clock, batch 4x32, clip_grad_norm_ + {'fused ' if args.fused else ''}AdamW"
          f"{', loss.item() each step' if args.loss_item else ''})\n")
    print("| model | trainable tensors | no watch, step | watch | ratio (median per round) | per tensor per step |")
    print("|---|---:|---:|---|---:|---:|")
    for label, build in (("tiny Llama, 4 layers", lambda: tiny_llama(4)),
                         ("LoRA (q,k,v,o r=8), 24 layers", lambda: tiny_lora(24))):
        base = build().to(args.device)
        names = ["no watch", "hook per parameter (before)", "fused read (after)", "no gradient read"]
        if args.read_deferred:
            names.insert(3, READ_DEFERRED_FIXED)
        # all copies, the baseline too
        variants = [FixedCostVariant(n, copy.deepcopy(base), fused=args.fused) for n in names]
        for tree, other in others.items():  # attached last: their clip wrappers go around this tree's
            names.append(f"fused read, {tree}")
            variants.append(FixedCostVariant(names[-1], copy.deepcopy(base), other, fused=args.fused))
        n_tensors = len(variants[0].params)
        for v in variants:
            v.run(batch, args.warmup, clock, args.device, args.loss_item)
        times: dict[str, list[float]] = {n: [] for n in names}
        for r in range(args.rounds):
            for v in variants[r % len(variants):] + variants[:r % len(variants)]:  # rotating order: drift hits every variant alike
                times[v.name].append(v.run(batch, args.steps_per_round, clock, args.device, args.loss_item))
        counted = {v.name: launches(v, batch, PROFILED_STEPS, args.device, args.loss_item)
                   for v in variants} if args.launches else {}
        for v in variants[1:]:
            assert v.watch is not None
            v.watch.flush()  # (read a step late: the last step is judged now)
            if v.watch._collector.enabled:  # (without gradient norms, zeros look like a dead run)
                assert v.watch.events == [], v.watch.summary()  # a healthy run: no alarm
            assert v.watch.step == args.rounds * args.steps_per_round + args.warmup + bool(args.launches) * PROFILED_STEPS
            v.watch.detach()
        baseline = times["no watch"]
        for name in names[1:]:
            ratio = statistics.median(t / b for t, b in zip(times[name], baseline))
            per_tensor = statistics.median(t - b for t, b in zip(times[name], baseline)) / n_tensors
            print(f"| {label} | {n_tensors} | {statistics.median(baseline) * 1e3:.2f} ms | {name} | {ratio:.3f}x "
                  f"| {per_tensor * 1e6:.2f} us |")
        if counted:
            columns = counted["no watch"][0]
            print(f"\n| {label}: per step | " + " | ".join(columns) + " |")
            print("|---|" + "---:|" * len(columns))
            for name, (counts, _) in counted.items():
                print(f"| {name} | " + " | ".join(f"{c:.1f}" for c in counts.values()) + " |")
            added = counted["fused read (after)"][1]
            added.subtract(counted["no watch"][1])
            print("\nthe fused read adds per step: " + ", ".join(
                f"{op} {n / PROFILED_STEPS:+g}" for op, n in sorted(added.items(), key=lambda kv: -kv[1]) if n) + "\n")


class UpdateNormVariant(FixedCostVariant):
    """The watch with its update norms on or off (issue 32 item 3), or off with option (a) beside it: the
    applied update rebuilt from AdamW's state after the step (lr * m_hat / (sqrt(v_hat) + eps) + lr * wd * w,
    fused ops, the same two norms), to compare with the weight copy the watch takes (option (b))."""

    def __init__(self, name: str, model: torch.nn.Module):
        from nbguard.watcher import WatchSettings

        self.name, self.model = name, model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=1e-5)
        self.watch = None
        if name != "no watch":
            settings = WatchSettings(update_norms=name.startswith("watch + update norms"))
            self.watch = NanWatch(model, optimizer=self.opt, settings=settings).attach()
        self.adam_state = name.startswith("watch + (a)")
        self.norms: list[torch.Tensor] = []

    def after_step(self) -> None:
        if self.adam_state:
            self.norms = self.update_from_state()

    @torch.no_grad()
    def update_from_state(self) -> list[torch.Tensor]:
        group = self.opt.param_groups[0]
        lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        params = [p for p in group["params"] if p in self.opt.state]
        states = [self.opt.state[p] for p in params]
        step = float(states[0]["step"])
        m = [s["exp_avg"] for s in states]
        denom = torch._foreach_sqrt([s["exp_avg_sq"] for s in states])
        torch._foreach_div_(denom, math.sqrt(1 - beta2 ** step))
        torch._foreach_add_(denom, eps)
        update = torch._foreach_div(m, denom)
        torch._foreach_mul_(update, lr / (1 - beta1 ** step))
        torch._foreach_add_(update, params, alpha=lr * wd)  # decoupled weight decay (of the weights before, ~after)
        return torch._foreach_norm(update) + torch._foreach_norm(params)


def update_norm_work(args) -> None:
    """The update norms' own work per step on the default mode's model (``--layers``, ``--hidden``, ``--vocab``;
    a full fine-tune), timed directly for both ways of comparing the weights with their copy: the copy before
    the step, the comparison and norms after it, and the host sums. Between repetitions a buffer larger than
    the caches is written, as the model's step evicts the weights in a real run."""
    from nbguard.watcher.components import update_norms

    model = build_model(args)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    watch = NanWatch(model, optimizer=opt).attach()
    model(**make_batch(args, 0)).loss.backward()
    opt.step()
    (reader,) = [d for d in watch.detectors if isinstance(d, update_norms.UpdateNorms)]
    evict = torch.empty(64 * 2 ** 20 // 4)
    clock = CLOCKS[args.clock]
    n = sum(p.numel() for p in reader.collector.params)
    print(f"\n### update-norm work per step ({n / 1e6:.1f}M trainable weights in {len(reader.collector.params)} "
          f"tensors, {args.rounds} repetitions each, {args.clock} clock, medians)\n")
    print("| path | copy before the step | compare + norms after it | host sums | in all |\n|---|---:|---:|---:|---:|")
    for label, gather_below in (("gathered (before issue 45: every model)", 2 ** 62),
                                ("per tensor (a full fine-tune now)", 0)):
        update_norms.GATHER_BELOW = gather_below
        reader._key = None  # (made again at the next copy, on this path)
        times = []
        for i in range(args.rounds + 2):
            evict.add_(1.0)
            start = clock()
            reader.before_step(10 ** 6 + i)
            copied = clock()
            evict.add_(1.0)
            after = clock()
            reader.after_step(10 ** 6 + i)
            pending = reader._pending
            assert pending is not None
            values = pending[1].tolist()  # (the device work waited for: the step's one read)
            compared = clock()
            reader.judge = type(reader.judge)()  # (no event from these repeated steps)
            summing = clock()
            reader._take(pending[0], values, pending[2])
            times.append((copied - start, compared - after, clock() - summing))
        times = times[2:]  # (the first two make the views and buffers)
        parts = [statistics.median(t[k] for t in times) for k in range(3)]
        print(f"| {label} | {parts[0] * 1e3:.2f} ms | {parts[1] * 1e3:.2f} ms | {parts[2] * 1e6:.0f} us "
              f"| {sum(parts) * 1e3:.2f} ms |")
    watch.detach()


def update_norm_cost(args) -> None:
    """The step time of the watch with update norms against the watch without them, interleaved."""
    clock = CLOCKS[args.clock]
    batch = tiny_batch(device=args.device)
    where = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else f"CPU, {torch.get_num_threads()} threads"
    print(f"\n### update norms ({where}, {args.rounds} rounds of {args.steps_per_round} steps, {args.clock} clock, "
          f"batch 4x32, clip_grad_norm_ + AdamW)\n")
    print("| model | trainable tensors | no watch, step | variant | ratio to no watch | ratio to watch without |")
    print("|---|---:|---:|---|---:|---:|")
    for label, build in (("tiny Llama, 4 layers", lambda: tiny_llama(4)),
                         ("LoRA (q,k,v,o r=8), 24 layers", lambda: tiny_lora(24))):
        base = build().to(args.device)
        names = ["no watch", "watch, update norms off", "watch + update norms (b: weight copy)",
                 "watch + (a) from AdamW's state, outside the watch"]
        variants = [UpdateNormVariant(n, copy.deepcopy(base)) for n in names]
        for v in variants:
            v.run(batch, args.warmup, clock, args.device)
        times: dict[str, list[float]] = {n: [] for n in names}
        for r in range(args.rounds):
            for v in variants[r % len(variants):] + variants[:r % len(variants)]:
                times[v.name].append(v.run(batch, args.steps_per_round, clock, args.device))
        on = variants[2].watch
        assert on is not None and on.events == [] and all(x is not None for x in on.history.total_update_norm[:-1])
        # the update-norm work alone, timed directly (steadier than a ratio of whole steps on a busy machine):
        # the copy before the step, the subtraction and norms after it, the host sums of the read's values
        from nbguard.watcher.components.update_norms import UpdateNorms

        (updates,) = [d for d in on.detectors if isinstance(d, UpdateNorms)]
        work = []
        for i in range(200):
            start = clock()
            updates.before_step(10 ** 6 + i)
            updates.after_step(10 ** 6 + i)
            pending = updates._pending
            assert pending is not None
            values = pending[1].tolist()  # (the watch's read: the same one host read as the step's)
            start_host = clock()
            updates.judge = type(updates.judge)()  # (a fresh judge: no event from these fake steps)
            updates._take(pending[0], values, pending[2])
            work.append((clock() - start, clock() - start_host))
        device_work = statistics.median(w[0] - w[1] for w in work)
        host_work = statistics.median(w[1] for w in work)
        for v in variants[1:]:
            assert v.watch is not None
            v.watch.detach()
        baseline, without = times["no watch"], times[names[1]]
        for name in names[1:]:
            ratio = statistics.median(t / b for t, b in zip(times[name], baseline))
            versus = statistics.median(t / b for t, b in zip(times[name], without))
            print(f"| {label} | {len(variants[0].params)} | {statistics.median(baseline) * 1e3:.2f} ms | {name} | "
                  f"{ratio:.3f}x | {versus:.3f}x |")
        print(f"| {label} | {len(variants[0].params)} | {statistics.median(baseline) * 1e3:.2f} ms | update-norm work "
              f"alone: copy + subtract + norms {device_work * 1e6:.0f} us, host sums {host_work * 1e6:.0f} us | "
              f"{1 + (device_work + host_work) / statistics.median(baseline):.4f}x | |")


class HooksOnly(FixedCostVariant):
    """The same kinds of hooks the watch registers, each returning at once (root forward pre/post hooks
    with kwargs, a hook on the loss, optimizer step pre/post hooks, a wrapped ``zero_grad``): what
    having hooks at all costs, with no work in them."""

    def __init__(self, name: str, model: torch.nn.Module):
        super().__init__("no watch", model)
        self.name = name
        model.register_forward_pre_hook(lambda module, args, kwargs: None, with_kwargs=True)
        model.register_forward_hook(lambda module, args, kwargs, out: out.loss.register_hook(lambda g: None) and None,
                                    with_kwargs=True)
        self.opt.register_step_pre_hook(lambda opt, args, kwargs: None)
        self.opt.register_step_post_hook(lambda opt, args, kwargs: None)
        original = self.opt.zero_grad
        self.opt.zero_grad = lambda set_to_none=True: original(set_to_none=set_to_none)  # type: ignore[method-assign]


class IrreducibleWork(FixedCostVariant):
    """What any watch with the same guarantees must do each step, and nothing more: keep references to
    the micro-batch and its RNG state, count its supervised tokens on the device, keep the loss with
    one hook on it, keep the clip's own per-tensor norms, and read norms, loss and count to the host
    in one ``cat``/``tolist`` with a finiteness check. The yardstick for the watch's own Python."""

    def __init__(self, name: str, model: torch.nn.Module):
        super().__init__("no watch", model)
        self.name = name
        self.micro_batches: list = []
        self.losses: list[torch.Tensor] = []
        self.norms: torch.Tensor | None = None
        self.backwards = 0
        self.history: list[list[float]] = []
        model.register_forward_pre_hook(self._pre, with_kwargs=True)
        model.register_forward_hook(self._post, with_kwargs=True)
        self.opt.register_step_pre_hook(self._read)
        self.opt.register_step_post_hook(self._end)

    def _pre(self, module, args, kwargs):
        count = torch.count_nonzero(kwargs["labels"][..., 1:] != -100)
        self.micro_batches.append((args, kwargs, torch.get_rng_state(), count))

    def _seen(self, grad):
        self.backwards += 1

    def _post(self, module, args, kwargs, output):
        output.loss.register_hook(self._seen)
        self.losses.append(output.loss.detach())

    def clip(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        from torch.nn.utils.clip_grad import _clip_grads_with_norm_

        from nbguard.watcher.reads.clip_tap import _clip_norms

        # the norms exactly as torch's clip_grad_norm_ takes them (its grouping, kernels and stack), so
        # the clip costs what the baseline's does
        _, _, self.norms, total = _clip_norms(params)
        _clip_grads_with_norm_(params, max_norm, total)
        return total

    def _read(self, optimizer, args, kwargs):
        values = torch.cat([self.norms, self.losses[0].reshape(1),
                            self.micro_batches[0][3].float().reshape(1)]).tolist()
        if not all(map(math.isfinite, values)):
            raise FloatingPointError("a planted check: this benchmark trains a healthy model")
        self.history.append(values)

    def _end(self, optimizer, args, kwargs):
        self.micro_batches, self.losses = [], []


def time_detectors(board) -> dict[str, list[int]]:
    """Wraps every hook the board dispatches on each of its detectors with a timer: ns per call, by
    "Detector.hook" (a hook that calls another of its own is counted in both)."""
    spent: dict[str, list[int]] = {}

    def timer(method, key: str):
        def timed(*args, **kwargs):
            start = time.perf_counter_ns()
            try:
                return method(*args, **kwargs)
            finally:
                spent.setdefault(key, []).append(time.perf_counter_ns() - start)
        return timed

    for hook, detectors in board._by_hook.items():
        for detector, method in detectors:
            setattr(detector, hook, timer(method, f"{type(detector).__name__}.{hook}"))
    board._index_hooks()  # (the same detectors per hook: each already implemented it)
    return spent


def hook_times(args) -> None:
    """Where the fixed part of a watched tiny-Llama step goes: the time spent inside each of the watch's
    four step hooks (``perf_counter_ns`` around each, medians) and inside each detector's hooks, the
    watch with its detectors removed, a copy with hooks that do nothing and one doing only the irreducible
    work (``IrreducibleWork``) against the whole watch (same rounds), and the cold first op: the supervised-token count run twice inside the forward pre-hook,
    first and again right after (so both watches pay one warm count more than they otherwise would)."""
    from nbguard.watcher.core import steps
    from nbguard.watcher.core.pipeline import DetectorBoard
    from nbguard.watcher.detectors import supervision

    inside: dict[tuple[str, int], list[int]] = {}  # (hook, id(watch)) -> ns per call

    def timed(name: str):
        method = getattr(steps.WatchSteps, name)

        def wrapper(watch, *a, **k):
            start = time.perf_counter_ns()
            try:
                return method(watch, *a, **k)
            finally:
                inside.setdefault((name, id(watch)), []).append(time.perf_counter_ns() - start)
        return wrapper

    hooks = ("_root_pre", "_root_post", "_pre_step", "_post_step")
    for name in hooks:  # (before the watches attach: their hooks are bound at attach)
        setattr(steps.WatchSteps, name, timed(name))
    counts: list[tuple[int, int]] = []
    count = supervision.supervised_count

    def count_twice(labels):
        start = time.perf_counter_ns()
        count(labels)
        middle = time.perf_counter_ns()
        result = count(labels)
        counts.append((middle - start, time.perf_counter_ns() - middle))
        return result

    supervision.supervised_count = count_twice
    clock = CLOCKS[args.clock]
    batch = tiny_batch()
    base = tiny_llama(4)
    variants = [FixedCostVariant(n, copy.deepcopy(base)) for n in ["no watch", "fused read", "fused read, no detectors"]]
    variants.append(HooksOnly("hooks that do nothing", copy.deepcopy(base)))
    variants.append(IrreducibleWork("the irreducible work only", copy.deepcopy(base)))
    variants[2].watch._board = DetectorBoard([])  # (the benchmark's ablation: no detector, no run check)
    per_detector = time_detectors(variants[1].watch._board)
    for v in variants:
        v.run(batch, args.warmup, clock)
    inside.clear()
    counts.clear()
    per_detector.clear()
    times: dict[str, list[float]] = {v.name: [] for v in variants}
    for r in range(args.rounds):
        for v in variants[r % len(variants):] + variants[:r % len(variants)]:
            times[v.name].append(v.run(batch, args.steps_per_round, clock))
    for v in variants[1:3]:
        v.watch.detach()
    steps = args.rounds * args.steps_per_round
    print(f"\n### inside the watch's hooks (tiny Llama, 4 layers, {args.rounds} rounds of {args.steps_per_round} "
          f"steps, {args.clock} clock)\n")
    print("| hook | median per call, whole watch | without detectors |\n|---|---:|---:|")
    for name in hooks:
        print(f"| {name} | " + " | ".join(f"{statistics.median(inside[name, id(v.watch)]) / 1e3:.1f} us"
                                         for v in variants[1:3]) + " |")
    print("\n| detector hook (whole watch) | calls per step | median per call | per step |\n|---|---:|---:|---:|")
    for key, spent in sorted(per_detector.items(), key=lambda kv: -sum(kv[1])):
        print(f"| {key} | {len(spent) / steps:.2f} | {statistics.median(spent) / 1e3:.1f} us "
              f"| {sum(spent) / steps / 1e3:.1f} us |")
    first, again = (statistics.median(c[i] for c in counts) / 1e3 for i in (0, 1))
    print(f"\nsupervised-token count in the forward pre-hook: first call {first:.1f} us, the same call right "
          f"after {again:.1f} us\n")
    baseline = times["no watch"]
    print("| variant | added per step (median per round) | ratio |\n|---|---:|---:|")
    for name in ("fused read", "fused read, no detectors", "hooks that do nothing", "the irreducible work only"):
        added = statistics.median(t - b for t, b in zip(times[name], baseline))
        ratio = statistics.median(t / b for t, b in zip(times[name], baseline))
        print(f"| {name} | {added * 1e6:.0f} us | {ratio:.3f}x |")


def copy_spread(args, copies: int = 5) -> None:
    """What separates variants that are only copies: ``copies`` unwatched copies of the tiny Llama, in the
    same rotating rounds as ``--fixed-cost``, each against the first. Any ratio away from 1.000 is the
    spread every copies-against-copies figure carries (``--paired`` has none)."""
    clock = CLOCKS[args.clock]
    batch = tiny_batch(device=args.device)
    base = tiny_llama(4).to(args.device)
    variants = [FixedCostVariant("no watch", copy.deepcopy(base)) for _ in range(copies)]
    for v in variants:
        v.run(batch, args.warmup, clock, args.device)
    times: list[list[float]] = [[] for _ in variants]
    for r in range(args.rounds):
        for i in [*range(r % copies, copies), *range(r % copies)]:  # rotating order, as --fixed-cost
            times[i].append(variants[i].run(batch, args.steps_per_round, clock, args.device))
    ratios = [statistics.median(t / b for t, b in zip(times[i], times[0])) for i in range(1, copies)]
    print(f"\n### {copies} unwatched copies of the tiny Llama ({args.rounds} rounds of {args.steps_per_round} "
          f"steps, {args.clock} clock), each against the first: "
          + ", ".join(f"{ratio:.3f}x" for ratio in ratios))


def paired(args) -> None:
    """The whole watch on and off on one copy of each model: ``detach`` and ``attach`` in alternate
    halves of each round (which half first alternates too), one untimed step after each switch. Copies
    of a model differ by up to 0.8% in step time here (``--copy-spread``: their memory, not their work),
    which copies-against-copies ratios carry; the same copy against itself does not."""
    clock = CLOCKS[args.clock]
    print(f"\n### the watch on and off on the same copy ({args.rounds} rounds of {args.steps_per_round} steps "
          f"each way, {args.clock} clock)\n")
    print("| model | trainable tensors | watch off, step | added per step (median of pairs) | ratio |")
    print("|---|---:|---:|---:|---:|")
    for label, build in (("tiny Llama, 4 layers", lambda: tiny_llama(4)),
                         ("LoRA (q,k,v,o r=8), 24 layers", lambda: tiny_lora(24))):
        variant = FixedCostVariant("fused read", build().to(args.device))
        assert variant.watch is not None
        variant.run(tiny_batch(device=args.device), args.warmup, clock, args.device)
        times: dict[bool, list[float]] = {False: [], True: []}
        for r in range(args.rounds):
            # a new batch each round, the same for both halves: ~1000 steps on one batch memorise it, and
            # the LoRA model's gradient norm then really jumps 5-20x (the watch names it, rightly)
            batch = tiny_batch(r, args.device)
            for watched in ((True, False) if r % 2 else (False, True)):
                (variant.watch.attach if watched else variant.watch.detach)()
                variant.run(batch, 1, clock, args.device)  # the switch's own step (a fresh attach's first)
                times[watched].append(variant.run(batch, args.steps_per_round, clock, args.device))
        assert variant.watch.events == [], variant.watch.summary()  # a healthy run: no alarm
        variant.watch.detach()
        off, on = times[False], times[True]
        added = statistics.median(b - a for a, b in zip(off, on))
        ratio = statistics.median(b / a for a, b in zip(off, on))
        print(f"| {label} | {len(variant.params)} | {statistics.median(off) * 1e3:.2f} ms | {added * 1e6:.0f} us "
              f"| {ratio:.3f}x |")


SLOPE_LAYERS = (6, 12, 24)  # LoRA on q/k/v/o: 8 trainable tensors per layer


def slope(args) -> None:
    """What grows with the number of trainable tensors: the same LoRA model on 6, 12 and 24 layers (48,
    96 and 192 adapter tensors), each with no watch, the watch's fused read and the hook per parameter,
    all in the same rounds (rotating order). The added time per step against no watch of the same size,
    and its least-squares line over the three sizes: the slope is the cost per trainable tensor per
    step, the intercept the part that does not grow with them."""
    clock = CLOCKS[args.clock]
    batch = tiny_batch()
    names = ["no watch", "fused read (after)", "hook per parameter (before)"]
    variants = []
    for layers in SLOPE_LAYERS:
        base = tiny_lora(layers)
        for name in names:
            variant = FixedCostVariant(name, copy.deepcopy(base))
            variant.layers = layers  # type: ignore[attr-defined]
            variants.append(variant)
    for v in variants:
        v.run(batch, args.warmup, clock)
    times: dict[tuple[int, str], list[float]] = {(v.layers, v.name): [] for v in variants}
    for r in range(args.rounds):
        for v in variants[r % len(variants):] + variants[:r % len(variants)]:
            times[v.layers, v.name].append(v.run(batch, args.steps_per_round, clock))
    for v in variants:
        if v.watch is not None:
            assert v.watch.events == [], v.watch.summary()  # a healthy run: no alarm
            v.watch.detach()
    print(f"\n### what grows with the trainable tensors (LoRA r=8 on q/k/v/o, {args.rounds} rounds of "
          f"{args.steps_per_round} steps, {args.clock} clock)\n")
    print("| layers | trainable tensors | no watch, step | " + " | ".join(f"{n}: added per step" for n in names[1:]) + " |")
    print("|---:|---:|---:|" + "---:|" * (len(names) - 1))
    tensors = [8 * layers for layers in SLOPE_LAYERS]
    added: dict[str, list[float]] = {n: [] for n in names[1:]}
    for layers, n_tensors in zip(SLOPE_LAYERS, tensors):
        baseline = times[layers, "no watch"]
        for name in names[1:]:
            added[name].append(statistics.median(t - b for t, b in zip(times[layers, name], baseline)))
        print(f"| {layers} | {n_tensors} | {statistics.median(baseline) * 1e3:.2f} ms | "
              + " | ".join(f"{added[n][-1] * 1e6:.0f} us" for n in names[1:]) + " |")
    print("\n| variant | per trainable tensor per step (slope) | not growing with them (intercept) |\n|---|---:|---:|")
    for name in names[1:]:
        per_tensor, fixed = statistics.linear_regression(tensors, added[name])
        print(f"| {name} | {per_tensor * 1e6:.2f} us | {fixed * 1e6:.0f} us |")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: as set)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--skip-debug", action="store_true", help="leave out DebugUnderflowOverflow")
    parser.add_argument("--watch-only", action="store_true", help="only baseline and the watch (plain and + activations)")
    parser.add_argument("--fixed-cost", action="store_true",
                        help="the watch's fixed cost on a 4-layer tiny Llama and a 24-layer LoRA model instead")
    parser.add_argument("--update-norms", action="store_true",
                        help="the watch with and without its per-group update norms (and option (a), the update "
                             "from AdamW's state), on the --fixed-cost models, interleaved")
    parser.add_argument("--update-norm-work", action="store_true",
                        help="the update norms' own work per step on the default mode's model, timed directly, "
                             "gathered against per tensor")
    parser.add_argument("--steps-per-round", type=int, default=5, help="--fixed-cost: steps per variant per round")
    parser.add_argument("--hook-times", action="store_true",
                        help="where the fixed part goes: time inside each step hook, the watch without its "
                             "detectors, and the cold first op (tiny Llama)")
    parser.add_argument("--slope", action="store_true",
                        help="what grows with the trainable tensors: LoRA on 6, 12 and 24 layers, the added "
                             "time per step and its slope per tensor")
    parser.add_argument("--paired", action="store_true",
                        help="the whole watch attached and detached in turns on one copy of each model (no "
                             "copy-to-copy spread in the ratio)")
    parser.add_argument("--copy-spread", action="store_true",
                        help="five unwatched copies of the tiny Llama against the first: the spread between "
                             "copies that --paired removes")
    parser.add_argument("--against", metavar="TREE", action="append", default=[],
                        help="also the watch of another checkout's nbguard (e.g. the previous release; "
                             "repeatable), in the same process and rounds (default mode and --fixed-cost)")
    parser.add_argument("--against-rev", metavar="REV", action="append", default=[],
                        help="as --against, for a commit of this repository (e.g. the previous release), "
                             "exported with git archive into a temporary folder; repeatable")
    parser.add_argument("--skip-localise", action="store_true", help="leave out the planted-NaN localisation")
    parser.add_argument("--skip-activations", action="store_true",
                        help="leave out the watch with its activation probe")
    parser.add_argument("--read-deferred", action="store_true",
                        help="also this tree's watch with WatchSettings(read='deferred') under policy skip (default "
                             "mode and --fixed-cost; with --fused its optimizer drops a bad update on the device)")
    parser.add_argument("--fused", action="store_true",
                        help="every variant's AdamW fused=True (the Trainer's default on a GPU; what --read-deferred "
                             "needs to skip on the device)")
    parser.add_argument("--update-norms-off", action="store_true",
                        help="also this tree's watch with WatchSettings(update_norms=False)")
    parser.add_argument("--launches", action="store_true",
                        help="--fixed-cost: also count, per step, the device kernels (CUDA), aten ops and host "
                             "waits on the device of each variant, and list the aten ops the fused read adds "
                             "(torch's profiler, 10 steps after the timed rounds)")
    parser.add_argument("--loss-item", action="store_true",
                        help="--fixed-cost: the loop reads loss.item() each step, as the Trainer and most "
                             "notebook loops do (on a GPU: a loop that already waits for each step)")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="wall (default) or cpu: this thread's CPU time, steadier on a busy machine "
                             "(use with --threads 1 on CPU only)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "cpu" and (args.device != "cpu" or torch.get_num_threads() != 1):
        parser.error("--clock cpu measures one thread: use it with --device cpu --threads 1")
    if args.update_norm_work:
        update_norm_work(args)
        return
    if args.update_norms:
        update_norm_cost(args)
        return
    if args.fixed_cost:
        fixed_cost(args)
        return
    if args.hook_times:
        hook_times(args)
        return
    if args.slope:
        slope(args)
        return
    if args.paired:
        paired(args)
        return
    if args.copy_spread:
        copy_spread(args)
        return

    n_params, variants, ratios = measure(args)
    base_median = statistics.median(variants[0].times)
    print(f"\n### nbguard watch overhead ({n_params / 1e6:.1f}M-parameter Llama, {args.device}, "
          f"batch {args.batch_size}x{args.seq_len}, {torch.get_num_threads()} threads, {args.rounds} rounds, "
          f"{args.clock} clock)\n")
    print("| variant | median step (ms) | ratio of medians | median per-round ratio | its quartiles |")
    print("|---|---:|---:|---:|---:|")
    for v in variants:
        med = statistics.median(v.times)
        low, _, high = statistics.quantiles(ratios[v.name], n=4)
        print(f"| {v.name} | {med * 1e3:.1f} | {med / base_median:.3f}x | {statistics.median(ratios[v.name]):.3f}x "
              f"| {low:.3f}-{high:.3f} |")

    if args.skip_localise:
        return
    loc = localise(args)
    same = "same step" if loc["steps_to_localise"] == 0 else f"{loc['steps_to_localise']} steps later"
    print(f"\n### time to localise (NaN planted in `{loc['target']}`)\n")
    print("| planted in | named | cause | localised | replay wall time | normal step |")
    print("|---|---|---|---|---:|---:|")
    print(f"| {loc['target']} | {loc['named']} | {loc['cause']} | {same} | {loc['replay_s'] * 1e3:.0f} ms "
          f"| {loc['step_s'] * 1e3:.0f} ms |")
    print(f"\n`detect_anomaly` on the same step says: {loc['anomaly_says']!r}")


if __name__ == "__main__":
    main()
