"""Real documents for the render and report tests: a tiny Llama trained for a few steps with a
planted overflow, its per-module gradient norms, and an event localised by forward hooks.

The fault is real: on one step a module (registered under a hostile name, the kind of string a
renderer must escape) multiplies its output past float32's range, the loss turns non-finite,
the step is skipped (grads set to None) and training goes on.
"""
from __future__ import annotations

import copy
import math
from functools import cache, lru_cache
from html.parser import HTMLParser

import torch
from torch import nn

from nbguard.findings import Event, Finding, Origin, Severity, document
from nbguard.testing import tiny_batch, tiny_llama

HOSTILE = '<script>alert("x")</script>&\'q'
HF_TOKEN = "hf_" + "AbCdEfGhIjKlMnOpQrStUvWxYz0123456789"  # built so it is not a literal secret
WANDB_KEY = "0123456789abcdef" * 2 + "01234567"


class Overflow(nn.Module):
    """Wraps a linear layer; when armed, scales its output past float32's range (a real inf)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner
        self.armed = False

    def forward(self, x):
        y = self.inner(x)
        return y * 1e39 if self.armed else y


class Holder(nn.Module):
    """Puts the Overflow module under a hostile name, so real module paths contain it."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.add_module(HOSTILE, Overflow(inner))

    def forward(self, x):
        return getattr(self, HOSTILE)(x)


def _group_of(name: str) -> str:
    return name.rsplit(".", 1)[0]  # the module that owns the parameter


def _first_nonfinite(model: nn.Module, batch: dict) -> Origin | None:
    """Replay the batch with a hook on every module: the first module whose output is non-finite."""
    found: list[Origin] = []
    handles = []

    def hook(name):
        def fn(module, inputs, output):
            if found or not torch.is_tensor(output):
                return
            if not torch.isfinite(output).all():
                ins = [t for t in inputs if torch.is_tensor(t) and t.is_floating_point()]
                found.append(Origin(
                    module=name, phase="forward", dtype=str(output.dtype),
                    input_absmax=float(ins[0].abs().max()) if ins else None,
                    output_absmax=float(output.abs().max()), tensor="output", micro_batch=0,
                    evidence={"shape": list(output.shape)},
                ))
        return fn

    for name, module in model.named_modules():
        if name:
            handles.append(module.register_forward_hook(hook(name)))
    try:
        with torch.no_grad():
            model(**batch)
    finally:
        for h in handles:
            h.remove()
    return found[0] if found else None


def _model_with_hostile_overflow():
    """A tiny Llama whose layer-1 down_proj sits under a module with a hostile name; arm it to overflow."""
    torch.manual_seed(0)
    model = tiny_llama(seed=0)
    mlp = model.model.layers[1].mlp
    mlp.down_proj = Holder(mlp.down_proj)
    return model, getattr(mlp.down_proj, HOSTILE)


@cache
def _planted_run(steps: int, bad_step: int) -> tuple:
    model, overflow = _model_with_hostile_overflow()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = list(dict.fromkeys(_group_of(n) for n, _ in params))
    grid = [[None] * steps for _ in groups]
    loss_hist, total, skipped, events = [], [], [], []
    for step in range(steps):
        batch = tiny_batch(2, 16, seed=step)
        overflow.armed = step == bad_step
        loss = model(**batch).loss
        loss.backward()
        sq = {g: 0.0 for g in groups}
        for n, p in params:
            if p.grad is not None:
                sq[_group_of(n)] += float(p.grad.float().norm()) ** 2
        for row, g in enumerate(groups):
            grid[row][step] = math.sqrt(sq[g]) if math.isfinite(sq[g]) else float("nan")
        total_norm = math.sqrt(sum(sq.values())) if all(math.isfinite(v) for v in sq.values()) else float("nan")
        loss_hist.append(float(loss.detach()))
        total.append(total_norm)
        if not (math.isfinite(loss_hist[-1]) and math.isfinite(total_norm)):
            origin = _first_nonfinite(model, batch)
            overflow.armed = False
            events.append(Event(
                kind="nonfinite-loss", step=step, cause="overflow",
                message=f"loss is {loss_hist[-1]} at step {step}; update skipped",
                origins=[origin] if origin else [],
                evidence={"loss": loss_hist[-1], "total_grad_norm": total_norm},
            ))
            skipped.append(step)
            for _, p in params:
                p.grad = None  # skip the update without touching AdamW's moments
            continue
        opt.step()
        opt.zero_grad(set_to_none=True)
    from nbguard.findings import encode_float

    history = {
        "groups": groups,
        "steps": list(range(steps)),
        "grad_norm": [[encode_float(v) for v in row] for row in grid],
        "skipped_steps": skipped,
        "loss": [encode_float(v) for v in loss_hist],
        "total_grad_norm": [encode_float(v) for v in total],
        "loss_scale": [None] * steps,
    }
    return history, [e.to_dict() for e in events]


def planted_watch_document(steps: int = 8, bad_step: int = 5, **extra) -> dict:
    """A "watch" document from the real planted-fault run (fresh copies, safe to mutate)."""
    history, events = _planted_run(steps, bad_step)
    return document("watch", title="planted overflow", events=copy.deepcopy(events),
                    history=copy.deepcopy(history), **extra)


def audit_document(**extra) -> dict:
    """An "audit" document with real Finding objects (one per severity) and a probe section."""
    findings = [
        Finding("fp16-overflow-risk", Severity.ERROR, "Activations overflow fp16",
                f"{HOSTILE} reaches 1e39, past fp16's 65504.", {"module": HOSTILE, "absmax": float("inf")},
                ["use-bf16"]),
        Finding("eval-cache", Severity.WARNING, "use_cache is on during eval", "HybridCache crash on 4.50.",
                {"use_cache": True}, ["disable-cache"]),
        Finding("info-note", "info", "Gradient checkpointing off", "Fine for tiny models.", {}, []),
    ]
    probe = {"limit": 65504.0, "modules": [
        {"module": f"model.layers.1.mlp.down_proj.{HOSTILE}", "dtype": "torch.float32", "absmax": "inf", "headroom": None},
        {"module": "model.layers.0.mlp.down_proj", "dtype": "torch.float32", "absmax": 12.5, "headroom": 65504.0 / 12.5},
    ]}
    cells = {"use-bf16": {"title": "Train in bf16", "code": "args.fp16 = False\nargs.bf16 = True"},
             "disable-cache": {"title": "Disable the KV cache", "code": "model.config.use_cache = False"}}
    from nbguard.hardware import PROFILES

    return document("audit", title="audit", findings=[f.to_dict() for f in findings], probe=probe,
                    hardware=PROFILES["t4"].to_dict(), fix_cells=cells, **extra)


def watched_run_with_planted_fault(steps: int = 4, bad_step: int = 2, policy: str = "skip", activations: bool = False):
    """A real ``nbguard.watch`` over a tiny Llama whose hostile-named module overflows on
    ``bad_step``; returns (model, watch)."""
    import nbguard

    model, overflow = _model_with_hostile_overflow()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with nbguard.watch(model, optimizer=opt, policy=policy, activations=activations) as watch:
        for step in range(steps):
            overflow.armed = step == bad_step
            model(**tiny_batch(2, 12, seed=step)).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    overflow.armed = False
    return model, watch


class Refs(HTMLParser):
    """Every start tag of an HTML page with its attributes: what a report references."""

    def __init__(self):
        super().__init__()
        self.tags = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
