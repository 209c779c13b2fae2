"""switch-precision's variant for a model that does not fit the GPU in fp32: only the layers that
overflow run in fp32, trainable weights become fp32, everything else stays as it is (fp16 mixed
precision and its GradScaler included).

A bitsandbytes 4-bit layer only needs its ``compute_dtype`` (its storage stays 4-bit). Any other
module gets fp32 weights and a forward that runs with autocast off on fp32 inputs: under fp16
autocast its matmuls would otherwise be cast back to fp16. Its fp32 output flows on; autocast
casts it where the next matmul wants fp16.
"""
from __future__ import annotations

import functools
from typing import Any

import torch

from ..introspect.dtypes import QUANTIZED_PARAM_CLASSES, dtype_name
from ..introspect.quantization import is_bnb_4bit_layer, set_compute_dtype
from ..step.eager import unwrap_compiled

MARK = "_nbguard_fp32_forward"  # set on a module whose forward runs in fp32: keeps apply idempotent


def _to_fp32(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != torch.float32:
        return value.float()
    return value


def fp32_forward(module: torch.nn.Module) -> None:
    """Run ``module.forward`` with autocast off on float32 inputs (an instance attribute)."""
    forward = module.forward
    device = next((p.device.type for p in module.parameters()), "cpu")

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device, enabled=False):
            return forward(*[_to_fp32(a) for a in args], **{k: _to_fp32(v) for k, v in kwargs.items()})

    module.forward = run
    setattr(module, MARK, True)


def apply_partial_fp32(model: torch.nn.Module, modules: list[str]) -> dict[str, Any]:
    changed: dict[str, Any] = {}
    casts = {}
    for name, p in model.named_parameters():  # the GradScaler needs fp32 trainable weights
        if p.requires_grad and p.is_floating_point() and p.dtype != torch.float32 \
                and type(p).__name__ not in QUANTIZED_PARAM_CLASSES:
            casts[name] = f"{dtype_name(p.dtype)} -> float32"
            p.data = p.data.float()
    root = unwrap_compiled(model)[0]  # module names are the user's (no torch.compile prefix)
    for name in modules:
        module = root.get_submodule(name)
        four_bit = {f"{name}.{n}" if n else name for n, m in module.named_modules() if is_bnb_4bit_layer(m)}
        if four_bit:
            changed.update(set_compute_dtype(model, torch.float32, only=four_bit))
            continue
        for pname, p in module.named_parameters():
            if p.is_floating_point() and p.dtype != torch.float32 and type(p).__name__ not in QUANTIZED_PARAM_CLASSES:
                casts[f"{name}.{pname}"] = f"{dtype_name(p.dtype)} -> float32"
                p.data = p.data.float()
        if not getattr(module, MARK, False):
            fp32_forward(module)
            changed[f"{name}.forward"] = "runs in float32 (autocast off)"
    if casts:
        changed["parameters"] = casts
    return changed


def partial_fp32_code(model: str, modules: list[str]) -> str:
    return f"""import functools

import torch

# The model does not fit this GPU in fp32: keep fp16 mixed precision, make the trainable weights
# float32, and run only the layers that overflow in float32 (a bf16-capable GPU is the other way out).
_fp32_layers = {modules!r}  # the modules the probe / watch saw overflow


def _fp32(x):
    return x.float() if isinstance(x, torch.Tensor) and x.is_floating_point() else x


for _name, _param in {model}.named_parameters():
    if _param.requires_grad and _param.is_floating_point() and _param.dtype != torch.float32:
        _param.data = _param.data.float()
for _layer_name in _fp32_layers:
    _layer = getattr({model}, "_orig_mod", {model}).get_submodule(_layer_name)  # (torch.compile's wrapper holds it)
    _4bit = [m for m in _layer.modules() if type(m).__module__.startswith("bitsandbytes") and hasattr(m, "compute_dtype")]
    for _m in _4bit:  # bitsandbytes 4-bit: storage stays 4-bit, only the matmul moves to fp32
        _m.compute_dtype, _m.compute_type_is_set = torch.float32, True
    if _4bit or getattr(_layer, "{MARK}", False):
        continue
    for _param in _layer.parameters():
        if _param.is_floating_point():
            _param.data = _param.data.float()
    _device = next(_layer.parameters()).device.type

    def _run_fp32(*args, _forward=_layer.forward, _device=_device, **kwargs):
        with torch.autocast(_device, enabled=False):
            return _forward(*[_fp32(a) for a in args], **{{k: _fp32(v) for k, v in kwargs.items()}})

    _layer.forward = functools.wraps(_layer.forward)(_run_fp32)
    _layer.{MARK} = True
"""
