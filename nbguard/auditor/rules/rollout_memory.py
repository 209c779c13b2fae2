"""The RL memory rule: a TRL GRPO/RLOO/Online DPO run whose training state, generation engine (vLLM
colocated) and logits do not fit the GPU audited against (:mod:`..rollout_memory`), with the setting that
makes them fit: the engine's share, or a smaller micro-batch with the same generation and optimizer batch."""
from __future__ import annotations

from typing import Any

from ..memory import GIB
from ..memory_offer import optimizer_bytes_per_value
from ..registry import finding, rule
from ..rollout_memory import RolloutMemory, rollout_memory


def _gb(n: int) -> str:
    return f"{n / GIB:.1f} GiB"


def _fixes(m: RolloutMemory, args: Any) -> list[dict[str, Any]]:
    """The settings that make the peak fit, the engine's share first (the knob that tips a colocated run)."""
    fixes: list[dict[str, Any]] = []
    share = m.utilization_that_fits()
    if share is not None:
        fixes.append({"vllm_gpu_memory_utilization": share})
    rows = m.rows_that_fit()
    if rows is not None:
        accumulation = getattr(args, "gradient_accumulation_steps", 1) or 1
        fixes.append({"per_device_train_batch_size": rows,
                      "gradient_accumulation_steps": accumulation * (m.rows // rows)})
    if m.engine_bytes and not fixes:
        fixes.append({"vllm_mode": "server"})
    return fixes


def _settings(fix: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in fix.items())


@rule("rl-rollout-oom", "error")
def rollout_oom(ctx):
    """A TRL RL run whose training state, colocated vLLM share and logits exceed the GPU: the out-of-memory
    it will hit, with the setting that fits."""
    args = ctx.args if ctx.args is not None else getattr(ctx.trainer, "args", None)
    m = rollout_memory(ctx, optimizer_bytes_per_value(ctx))
    if m is None or m.fits:
        return None
    parts = [f"training state {_gb(m.training_bytes)} (weights {_gb(m.parts['weights'])}, gradients "
             f"{_gb(m.parts['gradients'])}, optimizer state {_gb(m.parts['optimizer'])}, CUDA context "
             f"{_gb(m.parts['reserve'])})"]
    if m.engine_bytes:
        parts.append(f"vLLM's share {_gb(m.engine_bytes)} (vllm_gpu_memory_utilization={m.utilization:g} of "
                     f"{m.memory_gb:g} GB, colocated in this process)")
    if m.logits_bytes:
        parts.append(f"the logits {_gb(m.logits_bytes)} ({m.rows} rows x {m.completion_length} completion tokens x "
                     f"{m.vocab} vocabulary, the logits and their scaled copy kept for backward)")
    when = ("when vLLM wakes for generation (sleep mode frees its share only during the training step; the "
            "trainer's weights and optimizer state stay resident)" if m.sleep_mode and m.engine_bytes and
            m.engine_bytes > m.logits_bytes else "in the training step" + (", with vLLM's share held beside it" if
                                                                     m.engine_bytes and not m.sleep_mode else ""))
    fixes = _fixes(m, args)
    advice = ("Set " + _settings(fixes[0]) + (" (or " + "; or ".join(_settings(f) for f in fixes[1:]) + ")"
                                              if len(fixes) > 1 else "") + ".") if fixes else \
        "No share of the engine nor smaller micro-batch fits: train with LoRA or 4-bit weights, or a bigger GPU."
    if fixes and "per_device_train_batch_size" in fixes[0]:
        advice += " The generation batch and the optimizer's batch stay the same."
    fused = " The logits are not counted: TRL's fused LM head scores completions in tiles." if m.fused else ""
    return finding(
        "rl-rollout-oom",
        f"the RL run needs {_gb(m.peak_bytes)} of the {m.memory_gb:g} GB GPU: out of memory {when.split(' (')[0]}",
        f"Counted at the peak, {when}: " + "; ".join(parts) + f" = {_gb(m.peak_bytes)} against "
        f"{_gb(m.usable_bytes)} usable. Activations come on top, so the run cannot fit. " + advice + fused,
        {**m.to_dict(), "fix": fixes[0] if fixes else None, "fixes": fixes, "hardware": ctx.hardware.name})
