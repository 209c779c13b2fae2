"""What a checkpoint holds for ``trainer.train(resume_from_checkpoint=...)``, read before training resumes.

The Trainer resumes whatever it finds: without optimizer.pt it starts fresh AdamW moments (the loss jumps),
without rng_state.pth the data order and dropout differ, and the scheduler's lambdas are rebuilt from the
*new* arguments while its state (step, base learning rates) comes from scheduler.pt, so a changed
max_steps or warmup moves the learning rate at the resume step. :func:`read_checkpoint` collects the facts;
``rules/resume.py`` judges them.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from ..introspect.inert_pickle import InertObject, plain, read_torch_save
from ..introspect.user_files import UserFileError, field_of, read_json_object, safetensors_header, special_kind, str_map

OPTIMIZER, SCHEDULER, SCALER, STATE, ARGS = "optimizer.pt", "scheduler.pt", "scaler.pt", "trainer_state.json", "training_args.bin"
WEIGHTS = ("model.safetensors", "adapter_model.safetensors", "pytorch_model.bin", "adapter_model.bin",
           "model.safetensors.index.json")
FILES_SHOWN = 200  # names of the folder's files kept in the facts (and so in the document); files_total counts all


@dataclass
class CheckpointFacts:
    path: str
    files: list[str]  # the first FILES_SHOWN names, sorted
    missing: list[str] = field(default_factory=list)  # files a resume needs that are not there
    unreadable: dict[str, str] = field(default_factory=dict)  # file -> the error loading it gave
    state: dict[str, Any] = field(default_factory=dict)  # trainer_state.json without its log
    saved_args: Any = None  # the TrainingArguments' fields in training_args.bin (a namespace), read inertly
    args_pickle_calls: list[str] = field(default_factory=list)  # callables training_args.bin would run if unpickled
    scheduler: dict[str, Any] = field(default_factory=dict)  # base_lrs, last_epoch, _last_lr
    optimizer_params: int | None = None  # parameters the saved optimizer state covers
    last_lr_logged: tuple[int, float] | None = None  # (step, learning_rate) of the last log entry with one
    # the saved weights, name -> shape, from the safetensors headers (nothing loaded); None: not readable so
    adapter: bool = False  # an adapter checkpoint (adapter_config.json), else the whole model's weights
    weight_shapes: dict[str, list[int]] | None = None
    adapter_config: dict[str, Any] = field(default_factory=dict)
    files_total: int = 0  # how many files the folder holds


def resolve_checkpoint(value: Any, args: Any) -> str:
    """The checkpoint folder: the path given, or (True) the last checkpoint in args.output_dir, as Trainer does."""
    if value is True:
        from transformers.trainer_utils import get_last_checkpoint

        out = getattr(args, "output_dir", None)
        found = get_last_checkpoint(out) if out and os.path.isdir(out) else None
        if found is None:
            raise ValueError(f"resume_from_checkpoint=True, but output_dir {out!r} has no checkpoint-* folder: pass "
                             "the checkpoint's path")
        return found
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"resume_from_checkpoint must be a checkpoint folder (or True for the last one in "
                        f"output_dir); got {type(value).__name__}")
    path = os.fspath(value)
    if not os.path.isdir(path):
        raise ValueError(f"resume_from_checkpoint folder {path!r} does not exist: pass a checkpoint-N folder the "
                         "Trainer wrote under output_dir")
    return path


def _uses_scaler(args: Any, hardware: Any) -> bool:
    on_cpu = bool(getattr(args, "use_cpu", False)) or getattr(hardware, "device_type", None) == "cpu"
    return bool(getattr(args, "fp16", False)) and not on_cpu


def read_checkpoint(path: str, args: Any, hardware: Any = None) -> CheckpointFacts:
    files = sorted(os.listdir(path))
    facts = CheckpointFacts(path=path, files=files[:FILES_SHOWN], files_total=len(files))
    needed = [STATE, OPTIMIZER, SCHEDULER]
    if _uses_scaler(args, hardware):
        needed.append(SCALER)
    facts.missing = [f for f in needed if f not in files]
    if not any(f.startswith("rng_state") for f in files):
        facts.missing.append("rng_state.pth")
    if not any(f in files for f in WEIGHTS):
        facts.missing.append("model weights (model.safetensors or adapter_model.safetensors)")
    if STATE in files:
        try:
            _read_state(os.path.join(path, STATE), facts)
        except UserFileError as exc:
            facts.unreadable[STATE] = exc.reason
    for name in (OPTIMIZER, SCHEDULER, SCALER):
        if name not in files:
            continue
        kind = special_kind(os.path.join(path, name))
        if kind is not None:  # torch.load would wait on a FIFO for ever
            facts.unreadable[name] = f"is {kind}, not a regular file: nbguard does not read it"
            continue
        try:
            loaded = torch.load(os.path.join(path, name), map_location="cpu", weights_only=True)
        except Exception as exc:  # a truncated or corrupt file: resume would crash or start fresh
            facts.unreadable[name] = f"{type(exc).__name__}: {str(exc)[:300]}"
            continue
        if name == OPTIMIZER and isinstance(loaded, dict):
            groups = loaded.get("param_groups") or []
            facts.optimizer_params = sum(len(g.get("params", [])) for g in groups)
        if name == SCHEDULER and isinstance(loaded, dict):
            facts.scheduler = {k: loaded.get(k) for k in ("base_lrs", "last_epoch", "_last_lr")}
    facts.adapter = "adapter_config.json" in files
    facts.weight_shapes = saved_shapes(path, files, problems=facts.unreadable)
    if facts.adapter:
        try:
            facts.adapter_config = read_json_object(os.path.join(path, "adapter_config.json"))
        except UserFileError as exc:
            facts.unreadable["adapter_config.json"] = exc.reason
    if ARGS in files:
        _read_saved_args(os.path.join(path, ARGS), facts)
    return facts


def _read_state(path: str, facts: CheckpointFacts) -> None:
    """trainer_state.json, bounded (bytes, nesting) and checked field by field: the last logged learning
    rate, and everything but the log."""
    state = read_json_object(path)
    logged = []
    for entry in field_of(state, "log_history", list, path, default=[]):
        if not isinstance(entry, dict) or "learning_rate" not in entry or "step" not in entry:
            continue
        step, lr = entry["step"], entry["learning_rate"]
        if isinstance(step, bool) or not isinstance(step, (int, float)) \
                or isinstance(lr, bool) or not isinstance(lr, (int, float)):
            raise UserFileError(path, f"log_history has a step {str(step)[:40]!r} / learning_rate {str(lr)[:40]!r} "
                                      "that is not a number")
        logged.append((step, lr))
    for key in ("global_step", "max_steps", "train_batch_size", "num_train_epochs"):
        field_of(state, key, (int, float), path)  # the rules read these as numbers
    facts.last_lr_logged = (int(logged[-1][0]), float(logged[-1][1])) if logged else None
    facts.state = {k: v for k, v in state.items() if k != "log_history"}


def _read_saved_args(path: str, facts: CheckpointFacts) -> None:
    """The Trainer pickles its TrainingArguments into training_args.bin, and a downloaded checkpoint's pickle can
    name any callable: it is read with inert stand-ins (nothing it names is imported or run), never torch.load."""
    try:
        read = read_torch_save(path)
    except UserFileError as exc:  # a FIFO, a device, or far too large for a TrainingArguments
        facts.unreadable[ARGS] = exc.reason
        return
    except Exception as exc:  # a truncated or foreign file: not the Trainer's arguments
        facts.unreadable[ARGS] = f"{type(exc).__name__}: {str(exc)[:300]}"
        return
    facts.args_pickle_calls = read.unexpected_callables
    if isinstance(read.value, InertObject):
        fields = plain(read.value)
        if isinstance(fields, dict):
            facts.saved_args = SimpleNamespace(**fields)


def saved_shapes(path: str, files: list[str], problems: dict[str, str] | None = None) -> dict[str, list[int]] | None:
    """Every saved tensor's name and shape, read from the safetensors headers alone (bounded, checked against
    the file's size; the weights are not loaded; a sharded model's index names its shards). None where the
    weights are not in safetensors files, or a file cannot be read: ``problems`` (file -> what was wrong) says which."""
    problems = {} if problems is None else problems
    names: list[str] = [f for f in ("adapter_model.safetensors", "model.safetensors") if f in files]
    index = "model.safetensors.index.json"
    if index in files:
        try:
            weight_map = str_map(read_json_object(os.path.join(path, index)), "weight_map", os.path.join(path, index))
            names = sorted(set(weight_map.values()))
            outside = next((n for n in names if os.path.basename(n) != n or n in ("", ".", "..")), None)
            if outside is not None:
                raise UserFileError(index, f"names a shard {outside[:200]!r} outside the checkpoint folder")
        except UserFileError as exc:
            problems[index] = exc.reason
            return None
    if not names:
        return None
    shapes: dict[str, list[int]] = {}
    for name in names:
        try:
            header = safetensors_header(os.path.join(path, name))
        except UserFileError as exc:  # a truncated or foreign file: the resume's own load would fail on it
            problems[name] = exc.reason
            return None
        shapes.update({key: list(entry["shape"]) for key, entry in header.items()})
    return shapes


def planned_max_steps(trainer: Any, args: Any) -> int | None:
    """The number of optimizer steps the new run's scheduler is built for (Trainer's arithmetic, approximately)."""
    if getattr(args, "max_steps", -1) and args.max_steps > 0:
        return int(args.max_steps)
    dataset = getattr(trainer, "train_dataset", None)
    try:
        rows = len(dataset)  # type: ignore[arg-type]
    except TypeError:
        return None
    batches = rows / max(1, args.train_batch_size * max(1, getattr(args, "world_size", 1)))
    batches = math.floor(batches) if getattr(args, "dataloader_drop_last", False) else math.ceil(batches)
    per_epoch = max(1, math.ceil(batches / max(1, args.gradient_accumulation_steps)))
    return int(math.ceil(args.num_train_epochs * per_epoch))


def lr_after(args: Any, steps: int, max_steps: int, base_lr: float) -> float:
    """The learning rate the new arguments' schedule gives after ``steps`` scheduler steps from ``base_lr``."""
    from transformers import get_scheduler

    dummy = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([dummy], lr=base_lr)
    sched = get_scheduler(args.lr_scheduler_type, optimizer=opt, num_warmup_steps=args.get_warmup_steps(max_steps),
                          num_training_steps=max_steps, scheduler_specific_kwargs=args.lr_scheduler_kwargs or {})
    for _ in range(steps):
        opt.step()
        sched.step()
    return float(sched.get_last_lr()[0])
