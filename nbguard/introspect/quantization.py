"""What a bitsandbytes-quantised model really computes in, read off its layers.

``bnb_4bit_compute_dtype`` in the config is only what the model was loaded with: each
``bitsandbytes.nn.Linear4bit`` keeps its own ``compute_dtype`` (set from the config at load, but
anything may change it later, and a layer loaded without one takes the dtype of its first fp32 or
bf16 input, ``compute_type_is_set`` saying whether that happened). ``Linear4bit.forward`` casts
its input to ``compute_dtype``, runs the 4-bit matmul there and casts the result back: an fp16
``compute_dtype`` keeps the matmuls in fp16 whatever the rest of the model is in.

Nothing here imports bitsandbytes: layers are recognised by their class's module and attributes,
so an audit of a quantised model works wherever the model object exists.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from .dtypes import dtype_name


def is_bnb_4bit_layer(module: torch.nn.Module) -> bool:
    """A ``bitsandbytes.nn.Linear4bit`` (or LinearNF4/LinearFP4), not PEFT's wrapper of one."""
    return type(module).__module__.startswith("bitsandbytes") and hasattr(module, "compute_dtype") and \
        type(getattr(module, "weight", None)).__name__ == "Params4bit"


def is_bnb_8bit_layer(module: torch.nn.Module) -> bool:
    return type(module).__module__.startswith("bitsandbytes") and type(module).__name__ == "Linear8bitLt"


def effective_compute_dtype(layer: torch.nn.Module) -> torch.dtype | None:
    """The dtype the layer's matmul runs in; None: not decided yet (it follows the first input)."""
    dtype = getattr(layer, "compute_dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else None


def config_compute_dtype(config: Any) -> torch.dtype | None:
    """``bnb_4bit_compute_dtype`` of a BitsAndBytesConfig (or its dict form), when it loads 4-bit."""
    if config is None:
        return None
    get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
    if not (get("load_in_4bit", False) or get("_load_in_4bit", False)):
        return None
    dtype = get("bnb_4bit_compute_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.replace("torch.", ""), None)
    return dtype if isinstance(dtype, torch.dtype) else None


@dataclass
class QuantizationFacts:
    """The 4-bit/8-bit layers of a model and what they compute in (data; see :func:`read_quantization`)."""

    layers_4bit: list[tuple[str, torch.nn.Module]] = field(default_factory=list)
    layers_8bit: list[str] = field(default_factory=list)
    config_compute_dtype: torch.dtype | None = None
    kbit_prepared: bool = False  # what prepare_model_for_kbit_training leaves: see _looks_kbit_prepared

    @property
    def compute_dtypes(self) -> Counter:
        """dtype name ("unset" until the first forward decides) -> number of 4-bit layers."""
        return Counter(dtype_name(d) if d is not None else "unset"
                       for d in (effective_compute_dtype(m) for _, m in self.layers_4bit))

    @property
    def quant_types(self) -> Counter:
        return Counter(str(getattr(m.weight, "quant_type", None) or getattr(m, "quant_type", "?"))
                       for _, m in self.layers_4bit)

    @property
    def compute_dtype_set(self) -> set[torch.dtype]:
        """What the 4-bit matmuls run in: the layers' own dtypes, or the config's when no layer is seen."""
        if self.layers_4bit:
            return {d for d in (effective_compute_dtype(m) for _, m in self.layers_4bit) if d is not None}
        return {self.config_compute_dtype} if self.config_compute_dtype is not None else set()

    def layers_computing_in(self, dtype: torch.dtype) -> list[str]:
        return [n for n, m in self.layers_4bit if effective_compute_dtype(m) == dtype]

    @property
    def lora_wrapped(self) -> list[str]:
        """4-bit layers that are the ``base_layer`` of a PEFT LoRA layer."""
        return [n for n, _ in self.layers_4bit if n.endswith(".base_layer")]

    @property
    def any(self) -> bool:
        return bool(self.layers_4bit or self.layers_8bit or self.config_compute_dtype is not None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "layers_4bit": len(self.layers_4bit),
            "layers_8bit": len(self.layers_8bit),
            "compute_dtypes": dict(self.compute_dtypes),
            "quant_types": dict(self.quant_types),
            "config_compute_dtype": dtype_name(self.config_compute_dtype) if self.config_compute_dtype else None,
            "lora_on_4bit": len(self.lora_wrapped),
            "kbit_prepared": self.kbit_prepared,
        }


def _looks_kbit_prepared(model: torch.nn.Module, layers_4bit: list, floating: list[torch.nn.Parameter],
                        modules: list[torch.nn.Module]) -> bool:
    """PEFT's ``prepare_model_for_kbit_training`` leaves no marker of its own; what it leaves is
    every non-quantised floating weight in float32 (it upcasts fp16/bf16 ones) and, with
    gradient checkpointing, the input-embedding hook ``enable_input_require_grads`` installs."""
    if not layers_4bit or not floating:
        return False
    all_fp32 = all(p.dtype == torch.float32 for p in floating)
    hooked = any(getattr(m, "_require_grads_hook", None) is not None for m in modules)
    checkpointing = bool(getattr(model, "is_gradient_checkpointing", False))
    return all_fp32 and (hooked or not checkpointing)


def read_quantization(model: torch.nn.Module | None, config: Any = None,
                      modules: list[tuple[str, torch.nn.Module]] | None = None,
                      params: list[torch.nn.Parameter] | None = None) -> QuantizationFacts:
    """``modules``/``params``: the model's named modules and parameters when already listed."""
    if model is None:
        return QuantizationFacts(config_compute_dtype=config_compute_dtype(config))
    layers_4bit, layers_8bit = [], []
    named = modules if modules is not None else list(model.named_modules())
    for name, module in named:
        if is_bnb_4bit_layer(module):
            layers_4bit.append((name, module))
        elif is_bnb_8bit_layer(module):
            layers_8bit.append(name)
    floating = [p for p in (params if params is not None else model.parameters())
                if p.is_floating_point() and type(p).__name__ not in ("Params4bit", "Int8Params")]
    return QuantizationFacts(layers_4bit, layers_8bit, config_compute_dtype(config),
                             _looks_kbit_prepared(model, layers_4bit, floating, [m for _, m in named]))


def set_compute_dtype(model: torch.nn.Module, dtype: torch.dtype, only: set[str] | None = None) -> dict[str, str]:
    """Point every 4-bit layer (or those named in ``only``) at ``dtype`` for its matmuls.

    The 4-bit storage is untouched (never dequantised); ``compute_type_is_set`` keeps the layer
    from switching back to its first input's dtype. The config follows when every layer moves, so
    a save/reload keeps the choice.
    """
    changed = {}
    for name, layer in read_quantization(model).layers_4bit:
        if only is not None and name not in only:
            continue
        old = effective_compute_dtype(layer)
        if old != dtype:
            setattr(layer, "compute_dtype", dtype)  # noqa: B010  (a bitsandbytes attribute torch's typing does not know)
            changed[name] = f"{dtype_name(old) if old is not None else 'unset'} -> {dtype_name(dtype)}"
        setattr(layer, "compute_type_is_set", True)  # noqa: B010
    if only is None:
        for path, cfg in (("config", getattr(model, "config", None)),):
            q = getattr(cfg, "quantization_config", None)
            old = config_compute_dtype(q)
            if old is not None and old != dtype:
                if isinstance(q, dict):
                    q["bnb_4bit_compute_dtype"] = dtype_name(dtype)
                elif q is not None:
                    q.bnb_4bit_compute_dtype = dtype
                changed[f"{path}.quantization_config.bnb_4bit_compute_dtype"] = \
                    f"{dtype_name(old)} -> {dtype_name(dtype)}"
    return changed


def four_bit_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """bitsandbytes 4-bit layers: they cast their input to their own ``compute_dtype``."""
    return [(n, m) for n, m in model.named_modules()
            if type(m).__module__.startswith("bitsandbytes") and isinstance(getattr(m, "compute_dtype", None), torch.dtype)]
