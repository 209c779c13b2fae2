"""The public functions of nbguard, behind ``nbguard.audit`` / ``watch`` / ``explain`` / ``report``.

The notebook front end calls these too (never the package root, which imports the front end).
Each function imports its part of nbguard when called: ``import nbguard`` must not load torch.
"""
from __future__ import annotations


def audit(model=None, trainer=None, *, args=None, batch=None, hardware=None, probe=False, verify=False,
          resume_from_checkpoint=None, optimizer=None, scaler=None):
    """Audit a fine-tuning setup's precision against the hardware; returns an ``AuditResult``.

    The batch rules read ``batch`` (a dict of tensors, or a tokenizer's BatchEncoding) when given, else a few
    batches drawn from ``trainer.get_train_dataloader()`` with every RNG put back, so training is unchanged.
    ``verify=True`` runs every fix the findings offer on a shadow of one training step on ``batch``
    (the probe's synthetic batch when none is given): ``result.verification``.
    ``resume_from_checkpoint=PATH`` (or True: the last checkpoint in output_dir) checks, before
    ``trainer.train(resume_from_checkpoint=PATH)``, that the checkpoint resumes the run as it was.
    A plain loop passes its ``optimizer=`` (and ``scaler=``, a GradScaler): the optimizer rules read them
    (Adam's eps and update size against half-precision weights) and their fix cells act on them.
    """
    from .auditor import run_audit

    if not isinstance(verify, bool):
        raise TypeError(f"verify must be True or False; got {type(verify).__name__}")
    result = run_audit(model=model, trainer=trainer, args=args, batch=batch, hardware=hardware, probe=probe,
                       resume_from_checkpoint=resume_from_checkpoint, optimizer=optimizer, scaler=scaler)
    if verify:
        from .verifier.audit import verify_audit

        verify_audit(result, model, trainer, args, batch)
    return result


def watch(target, *, optimizer=None, scaler=None, policy="warn", config=None, log_to="auto", localize=True,
          activations=False, verify=True, detectors=(), log_every=10, rewind=None, scheduler=None,
          log_rows=False, save_report=None, settings=None, **deprecated):
    """Attach a NaN/Inf watch to a model (with its optimizer) or a Trainer; returns a ``NanWatch``.

    ``activations=True`` also records each module group's output abs-max per step (fp16 headroom).
    ``verify=True`` runs the fixes of the first localised NaN/Inf on a shadow of its step (at most
    about 3 step times); ``verify=False`` turns that off. ``detectors=[...]`` adds your own
    :class:`nbguard.watcher.Detector` instances (docs/guides/detectors.md). The checks for runs that stop
    learning without a NaN (divergence, dead runs, TRL's rewards and preference signals) are on unless
    ``config=nbguard.WatchConfig(run_checks={"enabled": False})``.
    ``log_to`` sends the per-group gradient norms, loss scale, skipped steps and events to a tracker
    (a SummaryWriter, a wandb/trackio/MLflow run, an accelerate.Accelerator) every ``log_every``
    steps, events at once; ``log_to="report_to"`` adds them to a Trainer's own logs, which is what the
    default ``log_to="auto"`` does for a Trainer whose ``report_to`` names integrations; ``log_to=None``
    sends nothing. Nothing goes out that you did not ask for: the rows an event names are quoted (a short
    excerpt of their text) only locally unless ``log_rows=True``; a watched Trainer's report file is written
    into its ``output_dir`` (the folder ``push_to_hub`` uploads) only with ``save_report=True`` (or
    ``save_report=PATH``); docs/guides/threat-model.md, "What goes where by default".
    ``policy="rewind"`` restores the last good snapshot on a NaN/Inf or divergence instead of losing the
    run (``rewind=nbguard.watcher.RewindSettings(every=50, budget_bytes=..., lr_factor=0.5,
    max_rewinds=3)``); pass ``scheduler=`` (a plain loop's LR scheduler) so a divergence's LR cut
    reaches it too. A bad step's event names its rows by dataset index (a Trainer's own loader; a
    plain loop's with ``watch.track_rows(loader)``).
    ``config=nbguard.WatchConfig(section={...})`` sets the watch's components, one section each
    (docs/guides/detectors.md, "Components", lists them with their settings); a component's older keyword works
    for one release, with a DeprecationWarning naming its section.
    ``settings=nbguard.watcher.WatchSettings(...)`` holds the watch's own thresholds and its read mode:
    ``read="deferred"`` judges each step a step late with no host wait (docs/guides/gradient-reads.md).
    """
    from .verifier import auto_verify
    from .watcher import NanWatch

    if not isinstance(verify, bool):
        raise TypeError(f"verify must be True or False, got {type(verify).__name__}")
    if not isinstance(log_rows, bool):
        raise TypeError(f"log_rows must be True or False, got {type(log_rows).__name__}")
    if log_to is None and save_report is not None:
        raise ValueError("save_report writes the report at the end of a watched Trainer's run, which needs "
                         "log_to='auto' or 'report_to' (log_to=None sends and saves nothing)")
    watch = NanWatch(target, optimizer=optimizer, scaler=scaler, policy=policy, localize=localize,
                     activations=activations, verifier=auto_verify if verify else None, detectors=detectors,
                     rewind=rewind, scheduler=scheduler, config=config, settings=settings, **deprecated)
    if log_to is not None:  # checked before attaching: a bad log_to leaves no hooks behind
        from .trackers import connect

        connect(watch, log_to, every=log_every, rows=log_rows, save_report=save_report)
    return watch.attach()


def callback(**options):
    """A transformers ``TrainerCallback`` that attaches ``nbguard.watch(trainer, **options)`` to the Trainer
    it is given to, for code that builds the Trainer and never hands it back::

        cb = nbguard.callback(policy="skip")
        run_exp(args, callbacks=[cb])  # LLaMA-Factory; or Trainer(..., callbacks=[cb])
        cb.watch.events

    It attaches when the Trainer is built (or when ``train()`` starts, after ``trainer.add_callback``);
    the watch is the one ``nbguard.watch(trainer)`` gives, with the same options (docs/guides/frameworks.md).
    """
    import functools

    from .watcher.integrations.trainer_callback import AttachOnInit

    _check_callback_options(options, set_by_callback=())
    return AttachOnInit(functools.partial(watch, **options))


def lightning_callback(*, module=None, **options):
    """A Lightning ``Callback`` that watches the LightningModule through ``trainer.fit``, with
    ``nbguard.watch``'s options (``policy=``, ``rewind=``, ``config=`` ...)::

        cb = nbguard.lightning_callback(policy="rewind")
        lightning.Trainer(callbacks=[cb]).fit(module, loader)
        cb.watch.events

    The optimizer, its LR scheduler and 16-mixed's GradScaler are Lightning's own, found at ``on_fit_start``;
    automatic and manual optimization are both watched. ``module="net"`` roots the watch at the submodule
    ``training_step`` calls where it does not call ``self(batch)``. ``log_to="lightning"`` sends the watch's
    scalars and events to the tracker behind the Trainer's logger (TensorBoardLogger's SummaryWriter,
    WandbLogger's run); other ``log_to`` values are ``nbguard.watch``'s (docs/guides/frameworks.md).
    """
    import functools

    from .watcher.integrations.lightning import lightning_callback as make

    _check_callback_options(options, set_by_callback=("optimizer", "scaler", "scheduler"))
    to_logger = options.get("log_to") == "lightning"
    if to_logger:  # the Trainer's logger is known at fit's start: the callback passes its tracker then
        options["log_to"] = None
    return make(functools.partial(watch, **options), module=module, to_logger=to_logger)


def _check_callback_options(options, set_by_callback):
    """What ``watch`` would refuse at attach, refused now: a callback attaches inside the framework's run."""
    import inspect

    from .watcher.policy.policies import check_policy

    taken = sorted(set(options) & {"target", *set_by_callback})
    if taken:
        raise TypeError(f"the callback sets {', '.join(taken)} itself from the framework's run; leave it out")
    inspect.signature(watch).bind(None, **options)
    check_policy(options.get("policy", "warn"))


def check_export(model, exported, *, trainer=None, tokenizer=None, batch=None, base=None):
    """Is the artifact you ship the model you trained? Returns an ``ExportResult`` (findings, logit comparisons).

    ``exported``: a folder written by ``save_pretrained`` (a PEFT adapter or a full model) or a model object
    (``copy.deepcopy(model).merge_and_unload()``). Probe batches (``batch=``, else the trainer's, else synthetic)
    go through the trained model, the model with its adapter disabled, and the artifact loaded back as users load
    it (the base named in adapter_config.json + the adapter; ``base=`` names a local base folder instead).
    ``tokenizer=`` (else the trainer's) is checked against the tokenizer saved beside the artifact.
    """
    from .auditor.export_check import run_export_check

    return run_export_check(model, exported, trainer=trainer, tokenizer=tokenizer, batch=batch, base=base)


def verify(subject, fix_id=None, **kwargs):
    """Run the candidate fixes of a watch event (or audit finding) on the failing step; returns a ``Verification``.

    ``nbguard.verify(watch.events[0])``; ``nbguard.verify(finding, model=model, batch=batch)``;
    ``fix_id="init-new-embeddings"`` checks one fix; ``memory_budget=`` (bytes) caps the step level.
    """
    from .verifier import verify as _verify

    return _verify(subject, fix_id, **kwargs)


def explain(exc):
    """A ``Diagnosis`` for a known error signature in ``exc``, or None."""
    from .explainer import explain as _explain

    return _explain(exc)


def report(audit=None, watch=None):
    """A ``Report``; with no arguments, everything this session recorded."""
    from .reporting import build_report

    return build_report(audit=audit, watch=watch)
