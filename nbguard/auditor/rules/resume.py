"""Resumes that continue: ``nbguard.audit(trainer=..., resume_from_checkpoint=PATH)`` reads the checkpoint
(``ctx.resume``, a CheckpointFacts) before ``trainer.train(resume_from_checkpoint=PATH)`` runs."""
from __future__ import annotations

import os
from typing import Any

from ..registry import finding, rule
from ..resume import CheckpointFacts, lr_after, planned_max_steps

CONSEQUENCE = {
    "optimizer.pt": "the Trainer silently starts fresh AdamW moments: the first steps after the resume take "
                    "full-size, unwarmed updates and the loss jumps",
    "scheduler.pt": "the learning-rate schedule restarts from step 0 (warmup again, or the peak LR at once)",
    "scaler.pt": "the GradScaler restarts at its initial scale: the first fp16 steps after the resume overflow "
                 "and are skipped",
    "rng_state.pth": "data order and dropout after the resume differ from the run that would have continued",
    "trainer_state.json": "the Trainer cannot tell the step to resume from",
}


def _facts(ctx: Any) -> CheckpointFacts | None:
    facts = getattr(ctx, "resume", None)
    return facts if isinstance(facts, CheckpointFacts) else None


def _trainable_count(ctx: Any) -> int:
    return sum(1 for _, p in ctx.named_params if p.requires_grad)


@rule("resume-checkpoint-incomplete", "error")
def resume_checkpoint_incomplete(ctx):
    """The checkpoint to resume from lacks (or cannot load) optimizer.pt, scheduler.pt, scaler.pt, rng_state.pth or its state."""
    facts = _facts(ctx)
    if facts is None:
        return None
    problems = {name: CONSEQUENCE.get(name, "the resume cannot load it") for name in facts.missing}
    problems.update({name: f"it does not load ({error})" for name, error in facts.unreadable.items()})
    trainable = _trainable_count(ctx)
    if facts.optimizer_params is not None and trainable and facts.optimizer_params != trainable:
        problems["optimizer.pt"] = (f"its state covers {facts.optimizer_params} parameters, this model trains "
                                    f"{trainable}: load_state_dict raises (another LoRA config, or other parameters "
                                    "frozen)")
    if not problems:
        return None
    names = ", ".join(problems)
    return finding(
        "resume-checkpoint-incomplete", f"the checkpoint cannot resume the run as it was: {names}",
        f"{facts.path}: " + "; ".join(f"{name}: {why}" for name, why in problems.items()) + ". Resume from a complete "
        "checkpoint (the one before, or save_only_model=False so the Trainer writes the optimizer, scheduler and RNG "
        "state), or accept a restart and say so.",
        {"checkpoint": facts.path, "missing": facts.missing, "unreadable": facts.unreadable, "files": facts.files,
         "optimizer_params": facts.optimizer_params, "trainable_params": trainable})


@rule("checkpoint-pickle-runs-code", "error")
def checkpoint_pickle_runs_code(ctx):
    """The checkpoint's training_args.bin names callables no saved TrainingArguments needs: unpickling it runs them."""
    facts = _facts(ctx)
    if facts is None or not facts.args_pickle_calls:
        return None
    calls = facts.args_pickle_calls
    return finding(
        "checkpoint-pickle-runs-code", f"training_args.bin would run {', '.join(calls[:3])} when unpickled",
        f"{facts.path}: training_args.bin is a pickle, and this one names {', '.join(calls[:10])}, which a saved "
        "TrainingArguments never needs. nbguard read it without running anything, and the Trainer does not load it "
        "to resume; but torch.load(..., weights_only=False) on it, or any tool that unpickles it, runs that code. "
        "Do not load this file; resume only from checkpoints you or a source you trust wrote, and delete "
        "training_args.bin from this one.",
        {"checkpoint": facts.path, "callables": calls[:20], "callables_count": len(calls)})


@rule("resume-batch-changed", "warning")
def resume_batch_changed(ctx):
    """The batch size or gradient accumulation of the resumed run differ from the checkpoint's run."""
    facts = _facts(ctx)
    if facts is None or ctx.args is None:
        return None
    changed = {}
    saved = facts.saved_args
    for key in ("per_device_train_batch_size", "gradient_accumulation_steps", "world_size"):
        old, new = getattr(saved, key, None), getattr(ctx.args, key, None)
        if old is not None and new is not None and old != new:
            changed[key] = [old, new]
    old_batch = facts.state.get("train_batch_size")
    if old_batch is not None and "per_device_train_batch_size" not in changed and old_batch != ctx.args.train_batch_size:
        changed["train_batch_size"] = [old_batch, ctx.args.train_batch_size]
    if not changed:
        return None
    return finding(
        "resume-batch-changed", "the resumed run uses another batch: " + ", ".join(
            f"{k} {v[0]} -> {v[1]}" for k, v in changed.items()),
        "The checkpoint's step count, epoch position and learning-rate schedule were computed for the old batch: "
        "resuming skips the wrong number of batches into the epoch, and the effective batch (and so the gradient "
        "noise the learning rate was tuned for) changes mid-run. Resume with the checkpoint's batch size and "
        "accumulation.", {"checkpoint": facts.path, "changed": changed})


@rule("resume-lr-jump", "warning")
def resume_lr_jump(ctx):
    """The new arguments' schedule gives another learning rate at the resume step than the checkpoint's run had."""
    facts = _facts(ctx)
    if facts is None or ctx.args is None:
        return None
    max_steps = planned_max_steps(ctx.trainer, ctx.args)
    if not max_steps:
        return None
    sched = facts.scheduler
    if sched.get("_last_lr") and sched.get("base_lrs") and isinstance(sched.get("last_epoch"), int):
        step, base, expected = sched["last_epoch"], float(sched["base_lrs"][0]), float(sched["_last_lr"][0])
        source = "scheduler.pt"
    elif facts.last_lr_logged is not None:
        logged_step, expected = facts.last_lr_logged
        step, base, source = max(0, logged_step - 1), float(ctx.args.learning_rate), "the checkpoint's last logged LR"
    else:
        return None
    new = lr_after(ctx.args, step, max_steps, base)
    if abs(new - expected) <= 0.01 * max(abs(new), abs(expected), 1e-12):
        return None
    old_max = facts.state.get("max_steps")
    why = (f"max_steps is {max_steps} now, {old_max} in the checkpoint: " if old_max and old_max != max_steps else "")
    return finding(
        "resume-lr-jump", f"the learning rate jumps at the resume: {expected:.3g} -> {new:.3g}",
        f"{why}the Trainer rebuilds the schedule from the new arguments and restores only its step and base "
        f"learning rate from scheduler.pt, so after step {step} the LR becomes {new:.3g} where the run was at "
        f"{expected:.3g} ({source}). Keep max_steps / num_train_epochs, warmup and lr_scheduler_type as they were "
        "when resuming, or start a new run.",
        {"checkpoint": facts.path, "step": step, "checkpoint_lr": expected, "resumed_lr": new, "max_steps": max_steps,
         "checkpoint_max_steps": old_max, "lr_scheduler_type": str(ctx.args.lr_scheduler_type)})


def _saved_as(model: Any) -> dict[str, list[int]]:
    """What the Trainer saves of this model, name -> shape: a PEFT model's adapter state (the names of
    adapter_model.safetensors), else the state dict without the tied copies save_pretrained leaves out."""
    from ..export import is_peft_model

    if is_peft_model(model):
        from peft.utils import get_peft_model_state_dict

        return {k: list(v.shape) for k, v in get_peft_model_state_dict(model).items()}
    out: dict[str, list[int]] = {}
    seen: set[tuple[int, tuple[int, ...]]] = set()
    for name, tensor in model.state_dict().items():
        key = (tensor.data_ptr(), tuple(tensor.shape))
        if tensor.numel() and key in seen:
            continue  # a tied copy (lm_head.weight of tied embeddings): saved once, under the first name
        seen.add(key)
        out[name] = list(tensor.shape)
    return out


def _base_path(model: Any) -> str | None:
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    name = getattr(getattr(base, "config", None), "_name_or_path", None)
    return name or None


def _adapter_differences(saved: dict[str, Any], model: Any) -> dict[str, list[Any]]:
    """The adapter settings of the checkpoint that the model's own PEFT config does not share."""
    from ..export import read_lora

    built = read_lora(model)
    out: dict[str, list[Any]] = {}
    for key in ("r", "lora_alpha"):
        if saved.get(key) is not None and built.get(key) is not None and saved[key] != built[key]:
            out[key] = [saved[key], built[key]]
    for key in ("target_modules", "modules_to_save"):
        old, new = saved.get(key), built.get(key)
        old_set = {old} if isinstance(old, str) else set(old or [])
        new_set = {new} if isinstance(new, str) else set(new or [])
        if old_set != new_set:
            out[key] = [sorted(old_set), sorted(new_set)]
    saved_base, built_base = saved.get("base_model_name_or_path"), _base_path(model)
    if saved_base and built_base and os.path.normpath(str(saved_base)) != os.path.normpath(str(built_base)):
        out["base_model_name_or_path"] = [saved_base, built_base]
    return out


@rule("resume-model-mismatch", "error")
def resume_model_mismatch(ctx):
    """The model the resumed run built is not the one the checkpoint saved: another base, other adapter settings, missing or reshaped weights."""
    from ..export import is_peft_model

    facts = _facts(ctx)
    if facts is None or ctx.model is None:
        return None
    problems: list[str] = []
    evidence: dict[str, Any] = {"checkpoint": facts.path, "adapter_checkpoint": facts.adapter}
    model_adapter = is_peft_model(ctx.model)
    if facts.adapter != model_adapter:
        problems.append("the checkpoint holds an adapter and the model has none (build the PEFT model as before)"
                        if facts.adapter else "the checkpoint holds the whole model and this one is a PEFT model: the "
                        "Trainer will not find adapter weights to resume")
    elif facts.adapter:
        differences = _adapter_differences(facts.adapter_config, ctx.model)
        evidence["adapter_differences"] = differences
        if "base_model_name_or_path" in differences:
            old, new = differences["base_model_name_or_path"]
            problems.append(f"the adapter was trained on the base from {old!r}, this run built it from {new!r}: the "
                            "resumed adapter sits on other weights than it learned against")
        settings = {k: v for k, v in differences.items() if k != "base_model_name_or_path"}
        if settings:
            problems.append("the adapter settings differ from the checkpoint's: " + ", ".join(
                f"{k} {v[0]} -> {v[1]}" for k, v in settings.items()))
    if facts.weight_shapes is not None and facts.adapter == model_adapter:
        expected = _saved_as(ctx.model)
        saved = facts.weight_shapes
        missing = sorted(k for k in expected if k not in saved)
        reshaped = {k: [saved[k], expected[k]] for k in expected if k in saved and saved[k] != expected[k]}
        unexpected = sorted(k for k in saved if k not in expected)
        evidence.update(missing=missing[:20], missing_count=len(missing), reshaped=dict(list(reshaped.items())[:20]),
                        unexpected=unexpected[:20], unexpected_count=len(unexpected))
        if reshaped:
            problems.append(f"{len(reshaped)} saved tensor(s) have another shape than the model's (e.g. "
                            f"{next(iter(reshaped))} {next(iter(reshaped.values()))[0]} -> "
                            f"{next(iter(reshaped.values()))[1]}): loading them raises")
        if missing:
            problems.append(f"{len(missing)} of the model's tensor(s) are not in the checkpoint (e.g. {missing[0]}): "
                            "the Trainer loads with strict=False, so they stay as this run initialised them")
        if unexpected:
            problems.append(f"{len(unexpected)} saved tensor(s) have no place in the model (e.g. {unexpected[0]}): "
                            "what they learned is dropped")
    if not problems:
        return None
    return finding(
        "resume-model-mismatch", "the model built for the resume is not the model the checkpoint saved",
        f"{facts.path}: " + "; ".join(problems) + ". Build the model as the checkpoint's run did (the same base path, "
        "config and PEFT settings: the checkpoint's config.json and adapter_config.json say which), then resume.",
        evidence)
