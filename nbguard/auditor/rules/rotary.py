"""Rotary embeddings whose cached inverse frequencies are not what the config says.

A rotary layer computes ``inv_freq`` once, when the model is built, from ``rope_theta`` and the
RoPE scaling (``rope_parameters`` in transformers 5, ``rope_theta``/``rope_scaling`` before). A config
edited afterwards (``model.config.rope_parameters["rope_theta"] = ...``, a scaling override for long
context) changes nothing in the forward pass, while ``save_pretrained`` writes the edited config: the
saved model then computes other positions than the one trained. A RoPE override that drops
``rope_theta`` (transformers 5 replaces the whole ``rope_parameters`` dict) reloads at another base.
The rule recomputes each rotary layer's frequencies with transformers' own functions
(``ROPE_INIT_FUNCTIONS``, the layer's ``compute_default_rope_parameters``) and compares.
"""
from __future__ import annotations

import json
import os
from typing import Any

import torch

from ..registry import finding, rule

SCALED_AT_RUNTIME = ("dynamic", "longrope")  # their inv_freq follows the sequence length: compare the original


def _rope_types(module: Any) -> dict[str | None, str]:
    """Layer type (None when the model has one kind of rotary layer) -> the RoPE type the config asks for now
    (a scaling override the layer never saw changes it), else the one the layer was built with."""
    kind = getattr(module, "rope_type", None)
    built: dict[str | None, str] = ({k: str(v) for k, v in kind.items()} if isinstance(kind, dict)  # per-layer-type RoPE (Gemma 3)
             else {None: str(kind or "default")})
    config = getattr(module, "config", None)
    params = getattr(config, "rope_parameters", None)
    if params is None:
        params = getattr(config, "rope_scaling", None)  # transformers 4.x: None means plain RoPE
    for layer_type in built:
        own = params.get(layer_type) if isinstance(params, dict) and layer_type else params
        if isinstance(own, dict) and (own.get("rope_type") or own.get("type")):
            built[layer_type] = str(own.get("rope_type") or own.get("type"))
    return built


def _buffer(module: Any, layer_type: str | None, rope_type: str) -> torch.Tensor | None:
    prefix = f"{layer_type}_" if layer_type else ""
    names = ([f"{prefix}original_inv_freq"] if rope_type in SCALED_AT_RUNTIME else []) + [f"{prefix}inv_freq"]
    return next((b for b in (getattr(module, n, None) for n in names) if isinstance(b, torch.Tensor)), None)


def expected_inv_freq(module: Any, layer_type: str | None, rope_type: str) -> torch.Tensor | None:
    """The frequencies the layer's own config implies, computed the way the layer computed them; None when the
    installed transformers offers no way to recompute them (then the rule stays silent)."""
    config = getattr(module, "config", None)
    init = getattr(module, "rope_init_fn", None)  # transformers 4.x keeps the function on the layer
    if init is None:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        init = (getattr(type(module), "compute_default_rope_parameters", None) if rope_type == "default"
                else ROPE_INIT_FUNCTIONS.get(rope_type)) or ROPE_INIT_FUNCTIONS.get(rope_type)
    if config is None or init is None:
        return None
    kwargs = {"layer_type": layer_type} if layer_type else {}
    return init(config, **kwargs)[0]  # the device defaults to the CPU in every release's signature


def theta_dropped(config: Any, layer_type: str | None) -> bool:
    """The config's RoPE parameters (transformers 5) exist but hold no rope_theta."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and layer_type:
        params = params.get(layer_type)
    return isinstance(params, dict) and params.get("rope_theta") is None


def implied_theta(inv_freq: torch.Tensor) -> float | None:
    """The base of a plain (unscaled) RoPE: inv_freq[i] = theta ** (-2i/dim), so theta = inv_freq[1] ** (-dim/2)."""
    if inv_freq.numel() < 2 or not 0 < float(inv_freq[1]) < 1:
        return None
    return float(inv_freq[1].double() ** (-inv_freq.numel()))


def _tolerance(cached: torch.Tensor) -> float:
    """Relative difference that counts: above rounding in the buffer's dtype (a bf16 model casts inv_freq to bf16)."""
    return max(1e-3, 2 * torch.finfo(cached.dtype).eps)


def stale_rotary_layers(modules: list[tuple[str, Any]]) -> list[dict[str, Any]]:
    """One dict per rotary layer (and layer type) whose cached frequencies differ from its config's
    (``modules``: the audit's one walk of the model)."""
    out: list[dict[str, Any]] = []
    for name, module in modules:
        if getattr(module, "config", None) is None or not any(n.endswith("inv_freq") for n in module._buffers):
            continue
        for layer_type, rope_type in _rope_types(module).items():
            cached = _buffer(module, layer_type, rope_type)
            if cached is None or cached.is_meta:
                continue
            try:
                expected = expected_inv_freq(module, layer_type, rope_type)
            except Exception as error:  # noqa: BLE001  (a remote-code layer may compute its own way: then stay silent)
                if not theta_dropped(module.config, layer_type):
                    continue
                # the config can no longer build this layer at all: a rope override that dropped rope_theta
                out.append({"module": name, "layer_type": layer_type, "rope_type": rope_type,
                            "config_error": f"{type(error).__name__}: {error}"[:200]})
                continue
            if expected is None or expected.shape != cached.shape:
                continue
            # in the buffer's own dtype: a half-precision model rounds small frequencies to subnormals
            cached_f = cached.detach().float().cpu()
            expected_f = expected.detach().cpu().to(cached.dtype).float()
            relative = float(((cached_f - expected_f).abs() / expected_f.abs().clamp_min(1e-30)).max())
            if relative <= _tolerance(cached):
                continue
            out.append({"module": name, "layer_type": layer_type, "rope_type": rope_type,
                        "max_abs_difference": float((cached_f - expected_f).abs().max()),
                        "max_relative_difference": relative,
                        "theta_of_cached": implied_theta(cached_f) if rope_type == "default" else None,
                        "theta_of_config": implied_theta(expected_f) if rope_type == "default" else None})
    return out


@rule("rotary-frequencies-stale", "error")
def rotary_frequencies_stale(ctx):
    """A rotary layer's cached inv_freq differs from what the model's config implies (config edited after the model was built, or a RoPE override the layer never saw)."""
    if ctx.model is None:
        return None
    stale = stale_rotary_layers(ctx.modules)
    if not stale:
        return None
    first = stale[0]
    where = first["module"] + (f" ({first['layer_type']} layers)" if first["layer_type"] else "")
    if "config_error" in first:
        return finding(
            "rotary-frequencies-stale", f"the config can no longer build the rotary layer {where}",
            f"Recomputing {where}'s frequencies from the model's config fails ({first['config_error']}): the RoPE "
            "settings were replaced after the model was built, most often by a rope_parameters / rope_scaling "
            "override without rope_theta (transformers 5 replaces the whole dict). The model still runs on the "
            "frequencies it cached, but the config save_pretrained writes cannot rebuild them: the saved model fails "
            "to load or loads at another base. Put rope_theta back into the override, "
            "e.g. config.rope_parameters = {**old_parameters, \"rope_type\": ..., \"factor\": ...}.",
            {"layers": stale[:10], "layers_affected": len(stale)})
    thetas = ""
    if first.get("theta_of_cached") and first.get("theta_of_config"):
        thetas = (f" The cached frequencies are those of rope_theta ~{first['theta_of_cached']:.4g}; the config "
                  f"says ~{first['theta_of_config']:.4g}.")
    return finding(
        "rotary-frequencies-stale",
        f"{where}'s cached inv_freq differs from the config's by up to {first['max_abs_difference']:.3g}",
        f"{len(stale)} rotary layer(s) hold inverse frequencies that the model's config does not imply (largest "
        f"relative difference {first['max_relative_difference']:.1%} in {where}).{thetas} The rotary layer computes "
        "inv_freq once, when the model is built: a config edited afterwards (rope_theta, rope scaling) changes nothing "
        "in training, but save_pretrained writes the edited config, so the reloaded model computes other positions "
        "than the one trained and its outputs move, silently. Set the RoPE parameters before building the model "
        "(from_pretrained(..., rope_parameters=...) or an edited config passed to from_pretrained), or rebuild the "
        "rotary layer from the edited config (model.model.rotary_emb = type(model.model.rotary_emb)(model.config)).",
        {"layers": stale[:10], "layers_affected": len(stale)})


def saved_config(config: Any) -> dict[str, Any] | None:
    """The config.json the model was loaded from (a local folder only; nothing is downloaded), its text part for a
    multimodal checkpoint whose text config is ``config``."""
    path = os.path.join(str(getattr(config, "_name_or_path", "") or ""), "config.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as handle:
            saved = json.load(handle)
    except (OSError, ValueError):
        return None
    if not isinstance(saved, dict):
        return None
    if getattr(config, "model_type", None) != saved.get("model_type") and isinstance(saved.get("text_config"), dict):
        return saved["text_config"]
    return saved


def saved_rope_theta(config: Any) -> float | None:
    """rope_theta in the config.json the model was loaded from: its rope_parameters' (transformers 5), else the
    top-level key (4.x)."""
    saved = saved_config(config)
    if saved is None:
        return None
    params = saved.get("rope_parameters") or {}
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    theta = theta if theta is not None else saved.get("rope_theta")
    return float(theta) if isinstance(theta, (int, float)) else None


def live_rope_theta(config: Any) -> tuple[bool, float | None]:
    """(whether the config has one RoPE base to compare, that base or None when it was dropped)."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_type" in params:  # transformers 5, one kind of rotary layer
        theta = params.get("rope_theta")
        return True, float(theta) if theta is not None else None
    if isinstance(params, dict):
        return False, None  # per-layer-type parameters (Gemma 3): compared by the rotary layers themselves
    theta = getattr(config, "rope_theta", None)
    return theta is not None, float(theta) if theta is not None else None


@rule("rope-theta-differs-from-checkpoint", "warning")
def rope_theta_differs_from_checkpoint(ctx):
    """The model's rope_theta is not the one in the config.json it was loaded from (a RoPE override that dropped or replaced it)."""
    for config in ctx.configs:
        saved = saved_rope_theta(config)
        comparable, live = live_rope_theta(config)
        if saved is None or not comparable or (live is not None and abs(live - saved) <= 1e-6 * saved):
            continue
        now = "no rope_theta at all" if live is None else f"rope_theta {live:g}"
        return finding(
            "rope-theta-differs-from-checkpoint",
            f"the model's config has {now}; the checkpoint it was loaded from says {saved:g}",
            f"{config._name_or_path}/config.json gives rope_theta {saved:g}, the model's config now {now}. The "
            "checkpoint's weights were trained with the saved base: a RoPE override (rope_parameters or rope_scaling "
            "in transformers 5 replaces the whole dict, dropping rope_theta unless it is repeated) moves every "
            "position's rotation, and perplexity on long inputs explodes (13.8 -> 11316 at 7.8K tokens in one "
            "report). Repeat rope_theta in the override; if the new base is intended (long-context training), "
            "ignore this.",
            {"saved_rope_theta": saved, "config_rope_theta": live, "loaded_from": str(config._name_or_path)})
    return None


def ignored_rope_theta(config: Any) -> tuple[float, float] | None:
    """(the ``rope_theta`` attribute set on the config, or the top-level key of the config.json it was loaded from,
    and the base its ``rope_parameters`` hold) when transformers 5
    ignores the former: it reads the base from ``rope_parameters`` only, so ``config.rope_theta = x`` set after the
    config was made (the 4.x way) changes nothing, and save_pretrained writes both."""
    params = getattr(config, "rope_parameters", None)
    stray = vars(config).get("rope_theta") if hasattr(config, "__dict__") else None
    if stray is None:  # a reload drops the attribute; the config.json it came from still shows both
        saved = saved_config(config) or {}
        stray = saved.get("rope_theta") if isinstance(saved.get("rope_parameters"), dict) else None
    if not isinstance(params, dict) or "rope_type" not in params or not isinstance(stray, (int, float)):
        return None
    used = params.get("rope_theta")
    if not isinstance(used, (int, float)) or abs(float(stray) - float(used)) <= 1e-6 * abs(float(used)):
        return None
    return float(stray), float(used)


@rule("rope-theta-ignored", "warning")
def rope_theta_ignored(ctx):
    """config.rope_theta set the transformers 4.x way, which transformers 5 ignores: the rotary layers use rope_parameters["rope_theta"], another base."""
    for config in ctx.configs:
        found = ignored_rope_theta(config)
        if found is None:
            continue
        stray, used = found
        return finding(
            "rope-theta-ignored", f"config.rope_theta is {stray:g} but the model uses rope_theta {used:g}",
            f"The config holds rope_theta {stray:g} as a plain attribute, while transformers 5 reads the RoPE base "
            f"from config.rope_parameters, which says {used:g}: the attribute (set the 4.x way, after the config "
            "was made) changes nothing, now or after save_pretrained and a reload, yet config.json shows both. Set "
            f"config.rope_parameters[\"rope_theta\"] = {stray:g} before the model is built (or pass rope_theta to "
            "the config's constructor), or delete the attribute if the base in rope_parameters is the one meant.",
            {"rope_theta_attribute": stray, "rope_parameters_theta": used})
    return None
