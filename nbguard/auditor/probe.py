"""The activation probe: one forward (and backward) pass that measures every module's value range.

Each forward hook keeps its module's output abs-max, and the abs-max of its positional inputs, as
tensors on the device; the values are read with one host sync at the end. Inputs matter because a
value can be born in a parent's own code between two children (``act(gate) * up`` inside an MLP):
no child's output shows it, but the next child's input does. Only positional inputs are read:
keyword inputs include additive attention masks that hold -inf or finfo.min on purpose.

When the model has trainable parameters the probe also runs backward and keeps, per module, the
abs-max of the gradient arriving at its outputs (a hook on each output tensor): some overflows only
happen in backward (a small activation multiplied by a large weight on the way back). Those values
join the same single host read. The model is left exactly as found: per-module train/eval flags,
every parameter's ``.grad`` (the previous tensors themselves), no hooks, no parameter changed.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..findings import encode_float
from ..introspect.dtypes import dtype_name
from ..introspect.modes import apply_modes, module_modes
from ..step.batch import forward_kwargs, model_device, synthetic_batch

FP16_MAX = 65504.0
NEAR_FACTOR = 2.0  # "near the limit" = within 2x of 65504


@dataclass
class ProbeModule:
    module: str
    dtype: str | None
    absmax: float  # of the module's outputs
    input_absmax: float = 0.0  # of its positional floating inputs
    grad_absmax: float | None = None  # of the gradient reaching its outputs in backward; None: no backward

    @property
    def peak(self) -> float:
        """The largest value seen at the module's boundary, inputs or outputs (NaN wins)."""
        if self.absmax != self.absmax or self.input_absmax != self.input_absmax:
            return float("nan")
        return max(self.absmax, self.input_absmax)

    @property
    def headroom(self) -> float | None:
        peak = self.peak
        if peak != peak:  # NaN: no headroom to speak of
            return None
        return FP16_MAX / peak if peak > 0 else None

    @property
    def grad_headroom(self) -> float | None:
        """limit / gradient abs-max: the largest loss scale at which this module's backward fits fp16."""
        g = self.grad_absmax
        if g is None or g != g:
            return None
        return FP16_MAX / g if g > 0 else None

    def to_dict(self) -> dict[str, Any]:
        return {"module": self.module, "dtype": self.dtype, "absmax": encode_float(self.absmax),
                "input_absmax": encode_float(self.input_absmax), "headroom": encode_float(self.headroom),
                "grad_absmax": encode_float(self.grad_absmax), "grad_headroom": encode_float(self.grad_headroom)}


@dataclass
class ProbeResult:
    modules: list[ProbeModule] = field(default_factory=list)
    loss: float | None = None
    backward: bool = False
    synthetic_batch: bool = False
    limit: float = FP16_MAX

    def near_limit(self, factor: float = NEAR_FACTOR) -> list[dict[str, Any]]:
        """Modules whose inputs or outputs are at or within ``factor`` of the fp16 limit (or non-finite), worst first."""
        near = [m for m in self.modules if not (m.peak * factor < self.limit)]  # NaN counts as near
        near.sort(key=lambda m: -(m.peak if m.peak == m.peak else float("inf")))
        return [{"module": m.module, "dtype": m.dtype, "absmax": m.absmax, "input_absmax": m.input_absmax,
                 "headroom": m.headroom} for m in near]

    def backward_near_limit(self, factor: float = NEAR_FACTOR) -> list[dict[str, Any]]:
        """Modules whose backward gradient is at or within ``factor`` of the fp16 limit (or non-finite), worst first.

        These gradients are unscaled: under fp16 mixed precision GradScaler multiplies them by its loss
        scale (65536 at the start), so a module listed here overflows at any scale of 1 or more.
        """
        near = [m for m in self.modules if m.grad_absmax is not None and not (m.grad_absmax * factor < self.limit)]
        near.sort(key=lambda m: -(m.grad_absmax if m.grad_absmax == m.grad_absmax else float("inf")))  # type: ignore[operator]
        return [{"module": m.module, "dtype": m.dtype, "grad_absmax": m.grad_absmax, "grad_headroom": m.grad_headroom}
                for m in near]

    def absmax(self, module: str) -> float | None:
        return next((m.absmax for m in self.modules if m.module == module), None)

    def to_dict(self) -> dict[str, Any]:
        return {"limit": self.limit, "modules": [m.to_dict() for m in self.modules],
                "loss": encode_float(self.loss), "backward": self.backward, "synthetic_batch": self.synthetic_batch}


def _floating_tensors(value):
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _floating_tensors(v)
    elif isinstance(value, dict):  # ModelOutput is a dict too
        for v in value.values():
            yield from _floating_tensors(v)


def run_probe(model: torch.nn.Module, batch: dict | None = None) -> ProbeResult:
    if any(p.is_meta for p in model.parameters()):
        raise ValueError("probe=True needs real weights; this model is on the meta device")
    synthetic = batch is None
    device = model_device(model)
    batch = {k: v.to(device) for k, v in (synthetic_batch(model) if batch is None else batch).items()}

    names = {m: n or type(model).__name__ for n, m in model.named_modules()}
    modes = module_modes(model)
    params = list(model.parameters())
    saved_grads = [p.grad for p in params]
    trainable = any(p.requires_grad for p in params)
    records: list[tuple[str, str | None, torch.Tensor]] = []
    grads: list[tuple[str, torch.Tensor]] = []  # filled by tensor hooks during backward

    def amax(tensors) -> torch.Tensor:
        if not tensors:
            return torch.zeros((), device=device)
        return torch.stack([t.detach().abs().amax().float().to(device) for t in tensors]).amax()

    def hook(module, inputs, output):
        tensors = list(_floating_tensors(output))
        if not tensors:
            return
        both = torch.stack([amax(tensors), amax(list(_floating_tensors(inputs)))])
        name = names[module]
        records.append((name, dtype_name(tensors[0].dtype), both))
        for t in tensors:
            # A hook on a non-leaf lives and dies with this forward's graph; one on a leaf (a module that
            # returns a parameter) would outlive the probe, and its gradient is the parameter's anyway.
            if t.requires_grad and not t.is_leaf:
                t.register_hook(lambda g, name=name: None if g is None else grads.append(
                    (name, g.detach().abs().amax().float().to(device))))  # None: a custom backward (bitsandbytes) sent none

    handles = [m.register_forward_hook(hook) for m in names]
    loss, did_backward = None, False
    try:
        model.eval()  # deterministic: no dropout, and what the model computes without noise
        with torch.set_grad_enabled(trainable):
            out = model(**forward_kwargs(model, batch))
            loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", None)
            did_backward = bool(trainable and loss is not None and loss.requires_grad)
            if did_backward and loss is not None:
                for p in params:
                    p.grad = None
                loss.backward()
        values = [r[2] for r in records] + [g.reshape(1).repeat(2) for _, g in grads]
        values += [loss.detach().float().reshape(1).repeat(2)] if loss is not None else []
        host = torch.stack(values).tolist() if values else []  # the one host sync: [[out, in], ...]
    finally:
        for h in handles:
            h.remove()
        apply_modes(modes)
        for p, g in zip(params, saved_grads):
            p.grad = g
    # A module called more than once (shared rotary embedding, tied layers) keeps its largest output.
    merged: dict[str, ProbeModule] = {}
    grad_host = host[len(records):len(records) + len(grads)]
    for (name, dt, _), (out_v, in_v) in zip(records, host[:len(records)]):
        old = merged.get(name)
        if old is None:
            merged[name] = ProbeModule(name, dt, out_v, in_v)
        else:  # max() would drop a NaN; keep it
            old.absmax = out_v if not (out_v <= old.absmax) else old.absmax
            old.input_absmax = in_v if not (in_v <= old.input_absmax) else old.input_absmax
    for (name, _), (g, _) in zip(grads, grad_host):
        module = merged[name]
        module.grad_absmax = g if module.grad_absmax is None or not (g <= module.grad_absmax) else module.grad_absmax
    if did_backward:  # a module whose outputs got no gradient (not on the loss path) saw 0
        for module in merged.values():
            if module.grad_absmax is None:
                module.grad_absmax = 0.0
    modules = list(merged.values())
    return ProbeResult(modules=modules, loss=host[-1][0] if loss is not None else None,
                       backward=did_backward, synthetic_batch=synthetic)
