"""What switch-precision should offer on this hardware: the full switch, or (when the model does
not fit the GPU in fp32) the partial fp32 variant, with the estimate that decided it."""
from __future__ import annotations

from typing import Any

from .memory import bf16_gpus_that_fit, estimate_memory

MAX_FP32_LAYERS = 8


def _parent(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def _finite(x: float) -> bool:
    return x == x and x not in (float("inf"), float("-inf"))


def overflowing_layers(probe: Any, model: Any) -> list[str]:
    """The modules where the probe saw values near the fp16 limit being made, to run in fp32.

    A parent is near the limit because a child is, so the deepest near modules are the candidates.
    A module that received a non-finite input only shows a consequence, unless a sibling made the
    value: then it was combined in their parent's code (``act(gate) * up`` inside an MLP) and the
    parent is the layer. Likewise a module near the limit only by its finite *input*.
    """
    if probe is None:
        return []
    near = {m["module"]: m for m in probe.near_limit()}
    leaves = [n for n in near if _is_submodule(model, n) and not any(o.startswith(n + ".") for o in near)]
    makers = [n for n in leaves if _finite(near[n]["input_absmax"])]
    chosen: list[str] = []
    for name in makers:
        m = near[name]
        by_input = _finite(m["absmax"]) and m["absmax"] < probe.limit / 2
        chosen.append(_parent(name) if by_input and _parent(name) else name)
    maker_parents = {_parent(n) for n in makers}
    chosen += [_parent(n) for n in leaves if n not in makers and _parent(n) in maker_parents and _parent(n)]
    chosen = list(dict.fromkeys(chosen))
    # a layer inside another chosen one already runs in fp32
    chosen = [c for c in chosen if not any(c.startswith(other + ".") for other in chosen)]
    return chosen[:MAX_FP32_LAYERS]


def _is_submodule(model: Any, name: str) -> bool:
    """A named module below the root (the probe names the root by its class)."""
    try:
        return model.get_submodule(name) is not model
    except AttributeError:
        return False


def optimizer_bytes_per_value(ctx: Any) -> int:
    optim = str(getattr(getattr(ctx.args, "optim", None), "value", getattr(ctx.args, "optim", "")) or "")
    return 2 if "8bit" in optim else 8


def memory_facts(ctx: Any) -> dict[str, Any] | None:
    """The estimate for the hardware audited against, and the switch-precision offer it implies."""
    hw = ctx.hardware
    if ctx.model is None or hw is None or not hw.is_gpu or hw.memory_gb is None:
        return None
    per_value = optimizer_bytes_per_value(ctx)
    params = [p for _, p in ctx.named_params]
    as_is = estimate_memory(ctx.model, "as-is", per_value, params=params)
    target = hw.best_half_precision
    switched = estimate_memory(ctx.model, target, per_value, params=params)
    facts: dict[str, Any] = {"hardware": hw.name, "memory_gb": hw.memory_gb, "as_is": as_is.to_dict(),
                             target: switched.to_dict(), "target_precision": target,
                             "target_fits": switched.fits(hw.memory_gb), "activations_counted": False}
    if target == "fp32" and switched.fits(hw.memory_gb) is False:
        layers = overflowing_layers(ctx.probe, ctx.model)
        partial = estimate_memory(ctx.model, "as-is", per_value, fp32_modules=set(layers), params=params)
        facts.update(partial=partial.to_dict(), partial_fits=partial.fits(hw.memory_gb), fp32_layers=layers,
                     bf16_gpus=bf16_gpus_that_fit(ctx.model, per_value, params),
                     offer={"to": "fp32", "only": layers})
    return facts


def memory_note(facts: dict[str, Any]) -> dict[str, Any]:
    """The short form added to each finding that offers switch-precision."""
    target = facts["target_precision"]
    note = {"hardware": facts["hardware"], "memory_gb": facts["memory_gb"],
            f"{target}_gb": facts[target]["total_gb"], "fits": facts["target_fits"],
            "counted": "weights, gradients, optimizer state and a reserve for the CUDA context",
            "reserve_gb": round(facts[target]["reserve_bytes"] / 2 ** 30, 2)}
    if "offer" in facts:
        note.update(partial_fp32_gb=facts["partial"]["total_gb"], fp32_layers=facts["fp32_layers"],
                    bf16_gpus=facts["bf16_gpus"],
                    offered="fp32 trainable weights and fp32 compute for the layers that overflow only")
    return note
