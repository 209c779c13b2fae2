"""The public functions of nbguard, behind ``nbguard.audit`` / ``watch`` / ``explain`` / ``report``.

The notebook front end calls these too (never the package root, which imports the front end).
Each function imports its part of nbguard when called: ``import nbguard`` must not load torch.
"""
from __future__ import annotations


def audit(model=None, trainer=None, *, args=None, batch=None, hardware=None, probe=False):
    """Audit a fine-tuning setup's precision against the hardware; returns an ``AuditResult``.

    The batch rules read ``batch`` (a dict of tensors, or a tokenizer's BatchEncoding) when given, else a few
    batches drawn from ``trainer.get_train_dataloader()`` with every RNG put back, so training is unchanged.
    """
    from .auditor import run_audit

    return run_audit(model=model, trainer=trainer, args=args, batch=batch, hardware=hardware, probe=probe)


def watch(target, *, optimizer=None, scaler=None, policy="warn", localize=True, activations=False):
    """Attach a NaN/Inf watch to a model (with its optimizer) or a Trainer; returns a ``NanWatch``.

    ``activations=True`` also records each module group's output abs-max per step (fp16 headroom).
    """
    from .watcher import NanWatch

    return NanWatch(target, optimizer=optimizer, scaler=scaler, policy=policy, localize=localize,
                    activations=activations).attach()


def explain(exc):
    """A ``Diagnosis`` for a known error signature in ``exc``, or None."""
    from .explainer import explain as _explain

    return _explain(exc)


def report(audit=None, watch=None):
    """A ``Report``; with no arguments, everything this session recorded."""
    from .reporting import build_report

    return build_report(audit=audit, watch=watch)
