"""Exact localisation: replay a bad step eagerly with hooks on every module.

Forward: the first non-finite value, in execution order. If a module's output is the first
non-finite value while its inputs were finite, it is the origin (innermost, since children finish
first). If a module's *input* is the first non-finite value, it was made in the code of the module
running around it (the parent, e.g. ``gate * up`` in an MLP): the parent is the origin and the child
that received it is evidence.

Backward: every module input is passed through an identity ``_Tap`` so the gradient a module sends
back through its own inputs is seen alone (a tensor hook on the input would sum every consumer, e.g.
the residual). Output tensor hooks give the incoming gradient; parameter hooks the parameter
gradients. The origin is the module whose incoming gradient was finite and whose outgoing
gradients were not, first in backward order.
"""
from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

from ...findings import Origin
from ...introspect.modes import in_training_mode
from ...introspect.unsloth import read_unsloth
from ...step.capture import MicroBatch, capture_rng, restore_rng
from ...step.eager import eager_everywhere, eager_name, unwrap_compiled
from ...step.precision import autocast_as
from ...step.tensors import Summary, float_tensors, iter_tensors, nonfinite_params, summarize
from .fused_loss import fused_loss_origin


class _Tap(torch.autograd.Function):
    """Identity whose backward reports the gradient passing through it."""

    @staticmethod
    def forward(ctx, x, report):
        ctx.report = report
        return x.clone()  # a clone, not a view: modules may write their input in place

    @staticmethod
    def backward(ctx, grad):
        ctx.report(grad)
        return grad, None


@dataclass
class Localisation:
    cause: str | None
    origins: list[Origin] = field(default_factory=list)
    evidence: dict[str, Any] = field(default_factory=dict)


class _ForwardProbe:
    """Forward hooks on every module; stops at the first non-finite value."""

    def __init__(self, names: dict[torch.nn.Module, str], micro_batch: int):
        self.names = names
        self.micro_batch = micro_batch
        self.stack: list[tuple[torch.nn.Module, Summary]] = []
        self.origin: Origin | None = None
        self.cause: str | None = None
        self.done = False
        self.children_ran: list[bool] = []  # per stack frame: did any child module run inside it?
        self.outputs: dict[torch.nn.Module, Summary] = {}  # the finite outputs so far (a fused loss's inputs)

    def pre(self, module, args, kwargs):
        if self.done:
            return None
        inputs = summarize(float_tensors(args, "args") + float_tensors(kwargs))
        if not inputs.finite and self.origin is None:
            self._origin_from_input(module, inputs)
        if self.children_ran:
            self.children_ran[-1] = True
        self.stack.append((module, inputs))
        self.children_ran.append(False)
        return None

    def _origin_from_input(self, child, inputs: Summary) -> None:
        child_name = self.names.get(child, "?")
        if not self.stack:  # the model itself was handed a non-finite input
            self.cause = "nonfinite-input"
            self.origin = Origin(child_name, "forward", inputs.dtype, inputs.absmax, None,
                                 inputs.first_bad, self.micro_batch, {"class": type(child).__name__})
            return
        parent, parent_inputs = self.stack[-1]
        bad = nonfinite_params(parent)
        self.cause = "nonfinite-parameter" if bad else inputs.cause
        evidence: dict[str, Any] = {"class": type(parent).__name__, "received_by": child_name,
                                    "received_as": inputs.first_bad,
                    "note": "the value arose in this module's own code, between its children"}
        if bad:
            evidence["nonfinite_values"] = bad
        tensor = ", ".join(bad) if bad else f"intermediate passed to {child_name} as {inputs.first_bad}"
        self.origin = Origin(self.names.get(parent, "?"), "forward", inputs.dtype, parent_inputs.absmax,
                             inputs.absmax, tensor, self.micro_batch, evidence)

    def post(self, module, args, kwargs, output):
        if self.done:
            return None
        _, inputs = self.stack.pop() if self.stack else (None, Summary())
        children_ran = self.children_ran.pop() if self.children_ran else True
        if self.origin is None:
            out = summarize(float_tensors(output, skip_masks=False))
            self.outputs[module] = out
            if not out.finite:
                bad = nonfinite_params(module)
                self.cause = "nonfinite-parameter" if bad else out.cause
                evidence = {"class": type(module).__name__}
                if bad:
                    evidence["nonfinite_values"] = bad
                bypassed = [self.names.get(c, "?") for c in module.children()] if not children_ran else []
                if bypassed:  # a fused kernel or compiled function used the children's weights directly
                    evidence["bypassed_children"] = bypassed[:10]
                    evidence["note"] = ("none of this module's children ran as modules (a fused kernel or a "
                                        "compiled function used their weights directly, bypassing their hooks): "
                                        "the value was made inside this module's forward, the nearest module "
                                        "the replay can see")
                self.origin = Origin(self.names.get(module, "?"), "forward", out.dtype, inputs.absmax,
                                     out.absmax, ", ".join(bad) if bad else out.first_bad,
                                     self.micro_batch, evidence)
                fused = fused_loss_origin(module, output, out, self.names, self.outputs, self.micro_batch)
                if fused is not None:  # the loss read the output embedding inside a fused kernel
                    self.cause, self.origin = fused
        return None


class _BackwardProbe:
    """Taps, output hooks and parameter hooks; events are ordered by a shared counter."""

    def __init__(self, names: dict[torch.nn.Module, str]):
        self.names = names
        self.clock = itertools.count()
        self.incoming: dict[torch.nn.Module, list[tuple[int, Summary]]] = {}
        self.outgoing: dict[torch.nn.Module, list[tuple[int, Summary, str]]] = {}
        self.param_handles: list = []

    def _record(self, table, module, extra=None):
        def record(grad):
            s = summarize([("grad", grad)])
            entry = (next(self.clock), s) if extra is None else (next(self.clock), s, extra)
            table.setdefault(module, []).append(entry)
        return record

    def pre(self, module, args, kwargs):
        if not torch.is_grad_enabled():
            return None

        def tap(value, name):
            if isinstance(value, torch.Tensor) and value.is_floating_point() and value.requires_grad:
                return _Tap.apply(value, self._record(self.outgoing, module, f"grad of input {name}"))
            return value

        new_args = tuple(tap(a, f"args[{i}]") for i, a in enumerate(args))
        new_kwargs = {k: tap(v, k) for k, v in kwargs.items()}
        return new_args, new_kwargs

    def post(self, module, args, kwargs, output):
        for _, t in iter_tensors(output):
            if t.is_floating_point() and t.requires_grad:
                t.register_hook(self._record(self.incoming, module))
        return None

    def hook_params(self, modules) -> None:
        for module in modules:
            for pname, p in module.named_parameters(recurse=False):
                if p.requires_grad:
                    self.param_handles.append(
                        p.register_hook(self._record(self.outgoing, module, f"grad of parameter {pname}")))

    def remove(self) -> None:
        for h in self.param_handles:
            h.remove()
        self.param_handles.clear()

    def origin(self, micro_batch: int) -> tuple[str | None, Origin | None, dict[str, Any]]:
        candidates = []
        for module, outs in self.outgoing.items():
            bad_out = [(t, s, what) for t, s, what in outs if not s.finite]
            if not bad_out:
                continue
            ins = self.incoming.get(module, [])
            if all(s.finite for _, s in ins):
                candidates.append((bad_out[0][0], module, bad_out[0], ins))
        first_bad_in = min(((t, m, s) for m, ins in self.incoming.items() for t, s in ins if not s.finite),
                           default=None, key=lambda e: e[0])
        if not candidates:
            if first_bad_in is not None:
                return first_bad_in[2].cause, None, {"note": "a non-finite gradient arrived at the model's "
                                                              "outputs from the loss computed outside it",
                                                      "received_by": self.names.get(first_bad_in[1], "?")}
            return None, None, {}
        _, module, (t, s, what), ins = min(candidates, key=lambda c: c[0])
        evidence = {"class": type(module).__name__, "gradient": what}
        if first_bad_in is not None and first_bad_in[0] > t:
            evidence["received_by"] = self.names.get(first_bad_in[1], "?")
        bad = nonfinite_params(module)
        cause = "nonfinite-parameter" if bad else s.cause
        in_absmax = max((x.absmax for _, x in ins if x.absmax is not None), default=None)
        return cause, Origin(self.names.get(module, "?"), "backward", s.dtype, in_absmax, s.absmax,
                             what.replace("grad of ", ""), micro_batch, evidence), evidence


def next_steps(model: torch.nn.Module) -> list[str]:
    """What to try when the eager replay stayed finite: the difference lies outside it."""
    steps = [
        "rerun the training step eagerly with compilation off: torch.compiler.set_stance('force_eager') "
        "around the step, or TORCHDYNAMO_DISABLE=1 before starting Python (a compiled kernel may compute "
        "differently from its eager form)",
        "make kernels deterministic while you look: torch.use_deterministic_algorithms(True) and "
        "CUBLAS_WORKSPACE_CONFIG=:4096:8 (a non-deterministic kernel may not repeat its NaN)",
        "the value may come from outside forward and backward: gradient accumulation across steps, "
        "a custom loss or optimizer hook, or data changed in place after the step",
    ]
    if read_unsloth(model).any:
        steps.insert(0, "Unsloth: set UNSLOTH_COMPILE_DISABLE=1 before loading the model (Unsloth reads it "
                        "at load to skip its compiled module rewrites) and rerun the step eagerly; its fused "
                        "kernels bypass module hooks, so the replay names their enclosing module")
    return steps


class Replayer:
    """Replays captured micro-batches on the eager model without leaving any trace on it."""

    def __init__(self, model: torch.nn.Module):
        self.eager, _ = unwrap_compiled(model)
        self.names = {m: eager_name(n) for n, m in self.eager.named_modules()}  # the user's names: no wrapper's

    @contextlib.contextmanager
    def _preserved(self):
        """Save grads, float buffers and the RNG; put them all back afterwards."""
        params = [p for p in self.eager.parameters()]
        grads = [p.grad for p in params]
        buffers = [(b, b.detach().clone()) for b in self.eager.buffers() if b.is_floating_point()]
        rng = capture_rng(host=True)  # (a forward may draw from random or NumPy too: all put back)
        for p in params:
            p.grad = None
        try:
            yield params
        finally:
            for p, g in zip(params, grads):
                p.grad = g
            with torch.no_grad():
                for b, saved in buffers:
                    b.copy_(saved)
            restore_rng(rng)

    def run(self, micro_batches: list[MicroBatch]) -> Localisation:
        with self._preserved() as params, eager_everywhere():
            for mb in micro_batches:
                found = self._replay_one(mb, params)
                if found is not None:
                    return found
        return Localisation("not-reproducible", [], {"micro_batches": len(micro_batches),
                                                     "note": "the eager replay of this step stayed finite",
                                                     "next_steps": next_steps(self.eager)})

    def _replay_one(self, mb: MicroBatch, params) -> Localisation | None:
        forward = _ForwardProbe(self.names, mb.index)
        backward = _BackwardProbe(self.names)
        do_backward = bool(mb.output_grads)
        handles = []
        try:
            for module in self.names:
                handles.append(module.register_forward_pre_hook(forward.pre, with_kwargs=True))
                handles.append(module.register_forward_hook(forward.post, with_kwargs=True))
                if do_backward:
                    handles.append(module.register_forward_pre_hook(backward.pre, with_kwargs=True))
                    handles.append(module.register_forward_hook(backward.post, with_kwargs=True))
            if do_backward:
                backward.hook_params(self.names)
            restore_rng(mb.rng)
            with in_training_mode(self.eager), torch.enable_grad(), autocast_as(mb.autocast):
                output = self.eager(*mb.args, **mb.kwargs)
            forward.done = True  # gradient checkpointing re-runs forwards during backward
            if forward.origin is not None:
                return Localisation(forward.cause, [forward.origin], {"micro_batch": mb.index})
            if not do_backward:
                return None
            targets, grads = [], []
            for path, t in iter_tensors(output):
                g = mb.output_grads.get(path)
                if g is not None and t.requires_grad:
                    targets.append(t)
                    grads.append(g.to(t.dtype))
            if not targets:
                return None
            torch.autograd.backward(targets, grads)
            for p in params:
                p.grad = None
            cause, origin, evidence = backward.origin(mb.index)
            if cause is None:
                return None
            # the origin carries its own evidence; the event keeps the note when there is no module
            return Localisation(cause, [origin] if origin else [],
                                {"micro_batch": mb.index, **({} if origin else evidence)})
        finally:
            for h in handles:
                h.remove()
            backward.remove()
