"""torchao Float8 and GPTQ/AWQ layers of a model, read off the live modules (bitsandbytes: quantization.py).

torchao leaves two kinds of layer. ``quantize_`` (e.g. ``Float8DynamicActivationFloat8WeightConfig``)
keeps ``nn.Linear`` and swaps its weight for a tensor subclass (``Float8Tensor``, ``Int4Tensor``, ...)
that carries how activations are quantised at each call (``act_quant_kwargs``: the granularity and
``hp_value_lb``, the lower bound on the scale's amax that the config calls ``activation_value_lb``).
The training recipe (``convert_to_float8_training``) swaps the module for ``Float8Linear`` with plain
high-precision weights. GPTQ and AWQ layers (auto-gptq, gptqmodel, autoawq, optimum) are their
libraries' own modules, which need a GPU to build: they are recognised by class name and module.

Nothing here imports torchao or any GPTQ/AWQ library: classes are read by name, so a model without
them costs a walk of its modules and nothing else.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class QuantizedLayer:
    name: str  # the module's name in the model
    kind: str  # "torchao-float8-training", "torchao-tensor", "gptq", "awq"
    cls: str  # the module's class, or the weight's tensor class for "torchao-tensor"
    granularity: str | None = None  # of the activation scale, when readable: "per-row", "per-tensor", ...
    activation_value_lb: float | None = None  # torchao's hp_value_lb (None: not set, or not readable)

    @property
    def per_row_unbounded(self) -> bool:
        """A torchao per-row activation scale with no lower bound: an all-zero activation row gets scale 0."""
        return self.kind == "torchao-tensor" and self.granularity == "per-row" and self.activation_value_lb is None

    def describe(self) -> str:
        if self.kind == "torchao-tensor":
            gran = f" {self.granularity}" if self.granularity else ""
            return f"torchao {self.cls}{gran}, activation_value_lb {self.activation_value_lb}"
        if self.kind == "torchao-float8-training":
            gran = f" {self.granularity}" if self.granularity else ""
            return f"torchao {self.cls} (float8 training{gran})"
        return f"{self.kind.upper()} {self.cls}"


@dataclass
class QuantizedLayers:
    layers: list[QuantizedLayer] = field(default_factory=list)
    quant_method: str | None = None  # the config's quantization_config.quant_method ("gptq", "awq", "torchao", ...)

    @property
    def any(self) -> bool:
        return bool(self.layers) or self.quant_method in ("gptq", "awq")

    def find(self, module_name: str) -> QuantizedLayer | None:
        """The layer named ``module_name``, or the quantised layer a PEFT wrapper of that name holds."""
        for layer in self.layers:
            if layer.name == module_name or layer.name == f"{module_name}.base_layer":
                return layer
        return None

    @property
    def kinds(self) -> Counter:
        return Counter(layer.describe() for layer in self.layers)

    def to_dict(self) -> dict[str, Any]:
        return {"layers": len(self.layers), "kinds": dict(self.kinds), "quant_method": self.quant_method}


def _granularity_name(granularity: Any) -> str | None:
    """torchao's ``PerRow()``/``PerTensor()`` (quantize_) or ``ScalingGranularity.AXISWISE`` (training), in words."""
    if granularity is None:
        return None
    if isinstance(granularity, (tuple, list)):  # (activation, weight)
        return _granularity_name(granularity[0]) if granularity else None
    name = getattr(granularity, "value", None) or type(granularity).__name__
    words = {"PerRow": "per-row", "PerTensor": "per-tensor", "PerBlock": "per-block", "PerGroup": "per-group",
             "PerAxis": "per-axis", "PerToken": "per-token", "tensorwise": "per-tensor", "axiswise": "per-row"}
    return words.get(str(name), str(name))


def _torchao_tensor_layer(name: str, weight: Any) -> QuantizedLayer:
    act = getattr(weight, "act_quant_kwargs", None)
    lb = getattr(act, "hp_value_lb", None)
    return QuantizedLayer(name, "torchao-tensor", type(weight).__name__,
                          _granularity_name(getattr(act, "granularity", None)),
                          float(lb) if isinstance(lb, (int, float)) else None)


def _float8_training_layer(name: str, module: torch.nn.Module) -> QuantizedLayer:
    cast = getattr(getattr(module, "config", None), "cast_config_input", None)
    return QuantizedLayer(name, "torchao-float8-training", type(module).__name__,
                          _granularity_name(getattr(cast, "scaling_granularity", None)))


_GPTQ_MODULES = ("auto_gptq", "gptqmodel", "optimum.gptq", "exllama", "exllamav2")
_AWQ_MODULES = ("awq",)


def _library_kind(module: torch.nn.Module) -> str | None:
    """"gptq"/"awq" for a GPTQ or AWQ linear layer, by its class (the libraries need a GPU to build one)."""
    cls = type(module)
    mod, name = cls.__module__, cls.__name__
    if name.startswith("WQLinear") or "awq" in name.lower() or mod.startswith(_AWQ_MODULES):
        return "awq" if ("Linear" in name or "linear" in mod) else None
    if mod.startswith(_GPTQ_MODULES) and ("QuantLinear" in name or "qlinear" in mod):
        return "gptq"
    return None


def quant_method(config: Any) -> str | None:
    """``quant_method`` of a quantization config (a QuantizationConfigMixin or its dict form), lower case."""
    if config is None:
        return None
    method = config.get("quant_method") if isinstance(config, dict) else getattr(config, "quant_method", None)
    method = getattr(method, "value", method)  # transformers keeps an enum
    return str(method).lower() if method is not None else None


def read_quantized_layers(model: torch.nn.Module | None, config: Any = None,
                          modules: list[tuple[str, torch.nn.Module]] | None = None) -> QuantizedLayers:
    """The torchao, GPTQ and AWQ layers of ``model`` (``modules``: its named modules when already listed);
    ``config``: the model's quantization_config, for its quant_method."""
    found = QuantizedLayers(quant_method=quant_method(config))
    if model is None:
        return found
    for name, module in modules if modules is not None else model.named_modules():
        cls = type(module)
        if cls.__module__.startswith("torchao") and cls.__name__ == "Float8Linear":
            found.layers.append(_float8_training_layer(name, module))
            continue
        weight = module.__dict__.get("_parameters", {}).get("weight")
        if weight is not None and type(weight).__module__.startswith("torchao"):
            found.layers.append(_torchao_tensor_layer(name, weight))
            continue
        kind = _library_kind(module)
        if kind is not None:
            found.layers.append(QuantizedLayer(name, kind, cls.__name__))
    return found
