"""Unsloth's own precision fix: its trainer flags and a reload with ``dtype=`` (never a cast).

Unsloth decides precision at load (``FastLanguageModel.from_pretrained(dtype=...)``: float16 on
GPUs without bf16, and for its FORCE_FLOAT32 families the forced-float32 mode) and its trainer
rewrites ``args.fp16``/``args.bf16`` from that (unsloth/models/rl.py). Casting weights or
rebuilding the accelerator behind its back would undo what it set, so this fix only sets the
flags Unsloth's own notebooks use (``fp16 = not is_bfloat16_supported()``, ``bf16 =
is_bfloat16_supported()``), leaves both off for a forced-float32 model (what Unsloth set), and
its cell reloads the model with the dtype Unsloth expects.
"""
from __future__ import annotations

from ..hardware import resolve_hardware
from ..introspect.unsloth import read_unsloth
from .registry import Fix, register


def _flags(forced_float32: bool, bf16: bool) -> dict[str, bool]:
    if forced_float32:  # Unsloth's forced-float32 mode: autocast off, its patches upcast
        return {"fp16": False, "bf16": False}
    return {"fp16": not bf16, "bf16": bf16}


def _native_bf16(hardware, bf16) -> bool:
    if isinstance(bf16, bool):
        return bf16
    return resolve_hardware(hardware).native_bf16


def _apply(target, hardware=None, bf16=None, **_):
    facts = read_unsloth(target.model, target.trainer, target.args)
    if not facts.any:
        raise ValueError("unsloth-precision is for models loaded with Unsloth (no Unsloth marker found: "
                         "model.config.unsloth_version or model._unsloth_forced_float32); use switch-precision")
    changed = {}
    if target.args is not None:
        for key, value in _flags(facts.forced_float32 is True, _native_bf16(hardware, bf16)).items():
            if getattr(target.args, key, None) != value:
                changed[f"args.{key}"] = f"{getattr(target.args, key)} -> {value}"
                setattr(target.args, key, value)
    return changed


def _code(names, hardware=None, bf16=None, **_):
    m = names.model
    code = f"""import torch
from unsloth import FastLanguageModel, is_bfloat16_supported

# Let Unsloth choose the precision at load: dtype=None is float16 where the GPU has no bf16, and for
# the families Unsloth knows overflow float16 (Gemma 3, ...) it switches to its float32-forced mode.
# Reload instead of casting: a cast would undo what Unsloth set up. (Every load rewrites
# UNSLOTH_FORCE_FLOAT32 and UNSLOTH_MIXED_PRECISION itself, so setting them by hand does nothing:
# dtype= is the switch. UNSLOTH_COMPILE_DISABLE=1, set before loading, turns its compiled rewrites off.)
{m}, tokenizer = FastLanguageModel.from_pretrained(
    model_name={m}.config._name_or_path,
    dtype=None,
    load_in_4bit=getattr({m}, "is_loaded_in_4bit", False),
)
"""
    if names.args:
        code += f"""
# Unsloth's own flags; its trainer turns both off again for a float32-forced model.
{names.args}.fp16 = not is_bfloat16_supported()
{names.args}.bf16 = is_bfloat16_supported()
"""
    return code


register(Fix("unsloth-precision", "Let Unsloth pick the precision (reload with dtype=)",
             "For models loaded with Unsloth: set fp16/bf16 as Unsloth does for this GPU (both off in its "
             "float32-forced mode) and reload with dtype=None instead of casting.",
             _apply, _code, needs="model-or-args",
             default_options=lambda hardware, fp16_in_use: {"bf16": resolve_hardware(hardware).native_bf16}))
