"""``%precision_check``, ``%nanwatch`` / ``%%nanwatch`` and ``%nbguard``: parse, resolve names, call the core.

Each magic declares its options with IPython's ``magic_arguments``, so ``%precision_check?`` is
its manual. Bad input raises :class:`IPython.core.error.UsageError`: one line, no traceback, and
the cell fails (so nbclient, papermill and "Run all" stop). A bug inside nbguard is never shown
as a usage error: it raises :class:`nbguard.NbguardError` naming itself a bug, with the original
traceback chained below it.
"""
from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from traitlets import Bool, Enum, TraitError, Unicode

from ..document.outward import outward_text, say, warn
from ..errors import NbguardError
from ..session import SESSION
from . import resolve as R
from .frontend import put_next_cell
from .resolve import MagicError
from .verdicts import cell_verdict_line

# the watch's policies and rewind schedules (watcher.policies, watcher.rewind), here without importing torch
# at %load_ext; tests/test_nanwatch_rewind_options.py checks they agree
POLICIES = ("warn", "skip", "stop", "rewind")
SCHEDULES = ("keep", "restore")
NBGUARD_COMMANDS = ("fix", "report", "explain", "export-check", "config", "help")
ISSUES_HINT = "this is a bug in nbguard, not in your notebook: please report it with the traceback below"


def internal_error(magic: str, err: BaseException) -> NbguardError:
    """nbguard's own error for a bug met while running ``magic`` (never disguised as bad input)."""
    return NbguardError(f"%{magic} failed inside nbguard ({type(err).__name__}: {err}); {ISSUES_HINT}")


def _parse(magic_func: Callable, line: str):
    """``parse_argstring`` with unbalanced quotes reported as a usage error too."""
    try:
        return parse_argstring(magic_func, line)
    except ValueError as err:  # shlex: "No closing quotation"
        raise MagicError(f"%{magic_func.__name__}: {err}") from None


class _WeakObjects:
    """The objects a view may act on again later (re-audit, Apply), held weakly.

    A view lives as long as its output; holding the model strongly there would keep a deleted
    model (and its GPU memory) alive. Objects that cannot be weakly referenced (a batch dict) are
    looked up again by their notebook name.
    """

    def __init__(self, ns: dict[str, Any], objects: dict[str, Any], names: dict[str, str]):
        self._ns, self._names = ns, dict(names)
        self._refs: dict[str, Callable[[], Any]] = {}
        for key, obj in objects.items():
            if obj is None:
                continue
            try:
                self._refs[key] = weakref.ref(obj)
            except TypeError:
                self._refs[key] = self._by_name(key)

    def _by_name(self, key: str) -> Callable[[], Any]:
        return lambda: R.lookup(self._ns, self._names[key])

    def get(self) -> dict[str, Any]:
        objects = {}
        for key, ref in self._refs.items():
            obj = ref()
            if obj is None:
                name = self._names.get(key, key)
                raise MagicError(f"{name!r} no longer exists (it was deleted or replaced); run the magic again")
            objects[key] = obj
        return objects


def _drop_refused_config(config: Any, cls: type) -> None:
    """A value ``%config`` refused (IPython logs the TraitError) still stays in the shell's config, and
    would make every later ``%load_ext nbguard`` fail: drop it, saying so, and keep the default."""
    if cls.__name__ not in config:
        return
    section = config[cls.__name__]
    for name, trait in cls.class_traits(config=True).items():  # type: ignore[attr-defined]
        if name not in section:
            continue
        value = section[name]
        try:
            trait.validate(None, value)
        except TraitError as exc:
            del section[name]
            warn(f"nbguard: ignoring c.{cls.__name__}.{name} = {value!r}: {exc}", RuntimeWarning, stacklevel=3)


@magics_class
class NbguardMagics(Magics):
    # The configuration surface: ``%config NbguardMagics.default_policy = "skip"`` (or in
    # ipython_config.py: ``c.NbguardMagics.default_policy = "skip"``). A magic's own option wins.
    default_policy = Enum(POLICIES, default_value="warn", config=True,
                          help="%nanwatch's policy when --policy is not given: warn, skip, stop or rewind")
    verify_fixes = Bool(True, config=True,
                        help="%nanwatch verifies the first NaN/Inf's fixes on a shadow of its step (False: off)")
    hardware_profile = Unicode("", config=True,
                               help="%precision_check's --hardware when not given (t4, a100, h100, ...); '' = this machine")
    dashboard_activations = Bool(False, config=True,
                                 help="the %nanwatch dashboard also draws the activation abs-max heatmap "
                                      "(as if --activations were given)")

    def __init__(self, shell, state):
        if shell is not None:  # a reloaded extension: %config must reach this instance, not the old one
            shell.configurables[:] = [c for c in shell.configurables if type(c).__name__ != type(self).__name__]
            _drop_refused_config(shell.config, type(self))
        super().__init__(shell)
        self.state = state  # the extension's state (watches started here, last names, ...)

    @property
    def ip(self) -> Any:
        """The shell (``Magics.shell`` is typed optional; a registered magic always has one)."""
        return self.shell

    @property
    def ns(self) -> dict[str, Any]:
        return self.ip.user_ns

    def _guarded(self, magic: str, func: Callable, *args: Any) -> Any:
        try:
            return func(*args)
        except UsageError as err:  # argparse's, from magic_arguments: say which magic it was
            message = str(err)
            raise UsageError(message if message.startswith("nbguard:") else f"nbguard: %{magic}: {message}") from None
        except MagicError as err:
            raise UsageError(f"nbguard: {err}") from None
        except Exception as err:
            raise internal_error(magic, err) from err

    # -- %precision_check ------------------------------------------------------------------------
    @magic_arguments()
    @argument("objects", nargs="*", metavar="OBJ",
              help="the Trainer, model and/or TrainingArguments to audit, by their notebook names (a plain "
                   "loop adds its optimizer and GradScaler) (default: the one Trainer in the notebook, else the "
                   "one top-level model)")
    @argument("--hardware", metavar="NAME", default=None,
              help="audit for this GPU instead of this machine: cpu, t4, v100, a10g, l4, a100, rtx3090, "
                   "rtx4090, h100, h200, b200, rtx5090")
    @argument("--probe", action="store_true",
              help="also run one forward/backward pass and check activations against the fp16 limit")
    @argument("--batch", metavar="NAME", default=None,
              help="the batch (a dict of tensors) the probe runs on; default: a synthetic batch")
    @argument("--verify", action="store_true",
              help="run each fix the findings offer on a shadow of one training step on the batch (your weights "
                   "untouched) and show which ones make it healthy")
    @line_magic
    def precision_check(self, line: str = ""):
        """Audit a fine-tuning setup's precision against the hardware; shows findings with fixes.

        Examples::

            %precision_check                       # the one trainer (or model) in the notebook
            %precision_check trainer --hardware t4 # as it would run on a Colab T4
            %precision_check model args --probe --batch batch
            %precision_check model optimizer scaler  # a plain loop: its optimizer's eps and updates too

        Configuration: ``%config NbguardMagics.hardware_profile = "t4"`` audits for that GPU by default.
        """
        return self._guarded("precision_check", self._precision_check, line)

    def _precision_check(self, line: str) -> None:
        from .. import api, fixes

        opts = _parse(self.precision_check, line)
        targets, names = self._audit_targets(opts.objects)
        batch = None
        if opts.batch:
            model = targets.get("model") or getattr(targets.get("trainer"), "model", None)
            batch = R.checked_batch(R.lookup(self.ns, opts.batch), opts.batch, model)
            names["batch"] = opts.batch
        hardware = self._hardware(opts.hardware or self.hardware_profile or None)
        self.state.last_names = {k: v for k, v in names.items() if k != "batch"}
        SESSION.names = dict(self.state.last_names)  # the audit's verified cells are written in these names
        result = api.audit(**targets, batch=batch, hardware=hardware, probe=opts.probe, verify=opts.verify)
        self.state.last_audit = result
        held = _WeakObjects(self.ns, dict(targets, batch=batch), names)
        fix_names = dict(self.state.last_names)

        def rerun():
            objects = held.get()
            return api.audit(**objects, hardware=hardware, probe=opts.probe, verify=opts.verify)

        def apply(fix_id: str):
            objects = held.get()
            options = result.fix_options(fix_id)
            applied = fixes.apply(fix_id, model=objects.get("model"), trainer=objects.get("trainer"),
                                  args=objects.get("args"), optimizer=objects.get("optimizer"),
                                  scaler=objects.get("scaler"), names=fix_names, **options)
            return applied.changed, applied.code

        from .present import show_audit

        show_audit(result, names=fix_names, rerun=rerun, apply=apply)

    @staticmethod
    def _hardware(name: str | None):
        if name is None:
            return None
        from ..hardware import resolve_hardware

        try:
            return resolve_hardware(name)
        except (KeyError, ValueError, TypeError) as err:
            raise MagicError(f"--hardware: {err.args[0] if err.args else err}") from None

    def _audit_targets(self, given: list[str]) -> tuple[dict[str, Any], dict[str, str]]:
        targets: dict[str, Any] = {}
        names: dict[str, str] = {}
        for name in given:
            obj = R.lookup(self.ns, name)
            kind = ("trainer" if R.is_trainer(obj) else "model" if R.is_model(obj)
                    else "args" if R.is_training_args(obj) else "optimizer" if R.is_optimizer(obj)
                    else "scaler" if R.is_scaler(obj) else None)
            if kind is None:
                raise MagicError(f"{name!r} is a {R.describe(obj)}; %precision_check takes a Trainer, "
                                 "a torch.nn.Module, TrainingArguments, or a plain loop's optimizer and GradScaler")
            if kind in targets:
                raise MagicError(f"two {kind}s given ({names[kind]} and {name}); audit one at a time")
            targets[kind], names[kind] = obj, name
        if targets and "model" not in targets and "trainer" not in targets and "args" not in targets:
            found = self._find_target("%precision_check")  # an optimizer alone: its model is the notebook's one
            targets[found[0]], names[found[0]] = found[2], found[1]
        model = targets.get("model") or getattr(targets.get("trainer"), "model", None)
        if "optimizer" in targets and model is not None and not R.optimizes(targets["optimizer"], model):
            raise MagicError(f"{names['optimizer']!r} updates none of the parameters of {names.get('model') or names.get('trainer')!r}; "
                             "name the optimizer built over this model's parameters")
        if not targets:
            found = self._find_target("%precision_check")
            targets[found[0]], names[found[0]] = found[2], found[1]
            if found[0] == "model":
                args = R.unique(R.candidates(self.ns, R.is_training_args), "TrainingArguments",
                                "name the one to audit: %precision_check model args")
                if args:
                    names["args"], targets["args"] = args
        tokenizer = getattr(targets.get("trainer"), "processing_class", None)
        if tokenizer is not None and R.name_of(self.ns, tokenizer, ""):  # data fix cells use the user's tokenizer name
            names["tokenizer"] = R.name_of(self.ns, tokenizer, "")
        return targets, names

    def _find_target(self, magic: str) -> tuple[str, str, Any]:
        """(kind, name, obj) of the one trainer, else the one top-level model, in the namespace."""
        trainer = R.unique(R.candidates(self.ns, R.is_trainer), "trainers", f"name one: {magic} trainer")
        if trainer:
            return ("trainer", *trainer)
        models = R.top_level_models(R.candidates(self.ns, R.is_model))
        model = R.unique(models, "models", f"name one: {magic} model")
        if model:
            return ("model", *model)
        raise MagicError(f"no Trainer or torch.nn.Module found in the notebook; name one: {magic} model")

    # -- %nanwatch / %%nanwatch ------------------------------------------------------------------
    @magic_arguments()
    @argument("target", nargs="?", metavar="OBJ",
              help="the Trainer or model to watch, by its notebook name (default: the one Trainer, else the "
                   "one top-level model); 'off' (line magic only) detaches the watch a line %%nanwatch started "
                   "(a %%%%nanwatch cell detaches its own when the cell ends)")
    @argument("--policy", choices=POLICIES, default=None,
              help="on a non-finite step: warn (record and go on), skip (drop that update), "
                   "stop (stop training; a plain loop gets nbguard.NonFiniteError), rewind (restore the "
                   "last good snapshot, docs/guides/rewind.md); default: "
                   "%%config NbguardMagics.default_policy (warn)")
    @argument("--every", metavar="K", type=int, default=None,
              help="--policy rewind: optimizer steps between snapshots (default 50)")
    @argument("--lr-factor", metavar="F", type=float, default=None,
              help="--policy rewind: the LR is multiplied by F after a divergence (default 0.5)")
    @argument("--max-rewinds", metavar="N", type=int, default=None,
              help="--policy rewind: rewinds before the next trouble stops training (default 3)")
    @argument("--schedule", choices=SCHEDULES, default=None,
              help="--policy rewind: keep (the LR scheduler keeps its place; default) or restore (it goes "
                   "back with the snapshot)")
    @argument("--scheduler", metavar="NAME", default=None,
              help="a plain loop's LR scheduler, so a rewind's LR cut (and --schedule restore) reaches it")
    @argument("--optimizer", metavar="NAME", default=None,
              help="the optimizer of a plain PyTorch loop (default: the one optimizer over the model)")
    @argument("--scaler", metavar="NAME", default=None,
              help="the torch.amp.GradScaler of a plain loop (default: the one GradScaler, if any)")
    @argument("--activations", action="store_true",
              help="also record each module group's activation abs-max per step (fp16 headroom heatmap)")
    @argument("--log-to", metavar="NAME", default="auto",
              help="also send gradient norms, loss scale, skipped steps and events to a tracker: the name of a "
                   "SummaryWriter, a wandb/trackio/MLflow run or an Accelerator, or report_to (a Trainer's "
                   "integrations); default auto (a Trainer's report_to, when it names any); none: no tracker")
    @argument("--ranks", action="store_true",
              help="the ranks a notebook_launcher in this cell forks: one dashboard with a row per rank "
                   "(implied when the cell calls notebook_launcher and names no object)")
    @argument("--config", metavar="SECTION.FIELD=VALUE", action="append", default=[],
              help="a setting of one of the watch's components, as nbguard.WatchConfig takes it (repeat it for "
                   "several): e.g. --config stall.after_s=600, --config run_checks.enabled=False; "
                   "`%%nbguard config` lists every section and field")
    @argument("--log-rows", action="store_true",
              help="the tracker also gets the excerpts of the rows an event names (off: they stay local)")
    @argument("--save-report", metavar="PATH", nargs="?", const=True, default=None,
              help="a watched Trainer writes its report at the end of training: into its output_dir, or PATH")
    @line_cell_magic
    def nanwatch(self, line: str = "", cell: str | None = None):
        """Watch training for NaN/Inf at one host read per step and name the module where it was born.

        As a line magic the watch stays on until ``%nanwatch off``; as a cell magic it watches the
        cell it heads, then detaches and says so in one line (its view shows the steps and events). If
        the watched cell raises, the cell fails with that error (traceback and diagnosis as usual).

        Examples::

            %nanwatch                               # the one trainer/model in the notebook
            %nanwatch model --optimizer opt --policy skip
            %nanwatch off

            %%nanwatch trainer --policy stop
            trainer.train()

        Configuration (``%config NbguardMagics``): ``default_policy`` ("warn"), ``verify_fixes``
        (True), ``dashboard_activations`` (False), e.g. ``%config NbguardMagics.default_policy = "skip"``.

        Around ``notebook_launcher(...)`` (``--ranks``, implied when the cell calls it and names no
        object) the forked ranks call ``nbguard.watch`` themselves and stream to one dashboard here,
        with a row per rank; ``%nbguard report`` then holds every rank::

            %%nanwatch
            notebook_launcher(train, num_processes=2)
        """
        if cell is None:
            return self._guarded("nanwatch", self._nanwatch_line, line)
        return self._guarded("nanwatch", self._nanwatch_cell, line, cell)

    def _nanwatch_line(self, line: str) -> None:
        opts = _parse(self.nanwatch, line)
        if opts.target == "off":
            if not self.state.watches:
                raise MagicError("no watch started by %nanwatch is running")
            from .display import new_output_id, publish

            for live in self.state.stop_watches():
                publish(dict(live.doc, output_id=new_output_id()))  # the final summary, here where it was switched off
            return
        self._start_watch(opts)

    def _nanwatch_cell(self, line: str, cell: str) -> None:
        opts = _parse(self.nanwatch, line)
        if opts.target == "off":
            raise MagicError("%%nanwatch watches the cell it heads; use %nanwatch off on its own line")
        outer = self.ip.displayhook.exec_result  # this cell's ExecutionResult (None outside run_cell)
        live = self._start_watch(opts, cell)
        try:
            inner = self.ip.run_cell(cell, store_history=False)
        finally:
            self.state.stop_watch(live)
            say(live.summary())  # one line under the view: what it does not show (detached, the policy)
        error = inner.error_before_exec or inner.error_in_exec
        if error is not None:
            # The inner cell already showed its traceback and diagnosis; make THIS cell fail with the
            # same error (nbclient/papermill stop) without printing it a second time.
            self.state.handler.already_shown(error)
            if outer is not None:
                outer.error_in_exec = error
            else:
                raise UsageError(f"nbguard: the watched cell raised {type(error).__name__} (traceback above)")

    def _start_watch(self, opts, cell: str | None = None):
        from .. import api
        from .present import LiveWatch

        if opts.ranks or (cell is not None and not opts.target and "notebook_launcher(" in cell):
            from .ranks import watch_forked_ranks  # nbguard.watch runs inside the forked ranks

            self.state.stop_watches()
            live = watch_forked_ranks()
            self.state.watches.append(live)
            return live
        if opts.target:
            target, name = R.lookup(self.ns, opts.target), opts.target
            if not (R.is_trainer(target) or R.is_model(target)):
                raise MagicError(f"{opts.target!r} is a {R.describe(target)}; %nanwatch takes a Trainer or a torch.nn.Module")
        else:
            _kind, name, target = self._find_target("%nanwatch")
        # the cells the watch verifies are written with the name the user watches it by
        kind = "trainer" if R.is_trainer(target) else "model"
        SESSION.names = {**{k: v for k, v in self.state.names_for_fixes().items() if k not in ("trainer", "model")},
                         kind: name}
        optimizer = scaler = None
        if R.is_model(target):
            optimizer = self._optimizer_for(target, opts.optimizer)
            scaler = self._named(opts.scaler, R.is_scaler, "a torch.amp.GradScaler") if opts.scaler else \
                self._unique_optional(R.is_scaler, "GradScalers", "name it: --scaler NAME")
            # a plain loop's cells act on its optimizer (and name its GradScaler) by the notebook's names
            SESSION.names["optimizer"] = opts.optimizer or R.name_of(self.ns, optimizer, "optimizer")
            if scaler is not None:
                SESSION.names["scaler"] = opts.scaler or R.name_of(self.ns, scaler, "scaler")
        elif opts.optimizer or opts.scaler:
            option = "--optimizer" if opts.optimizer else "--scaler"
            raise MagicError(f"{option} is for a model; a Trainer brings its own optimizer and scaler")
        self.state.stop_watches()  # one %nanwatch at a time: never two watches on the same run
        log_to = None if opts.log_to == "none" else opts.log_to if opts.log_to in ("auto", "report_to") \
            else R.lookup(self.ns, opts.log_to)
        policy = opts.policy or self.default_policy
        rewind, scheduler = self._rewind_options(opts, policy, target)
        watch = api.watch(target, optimizer=optimizer, scaler=scaler, policy=policy, config=self._watch_config(opts),
                          activations=opts.activations or self.dashboard_activations, verify=self.verify_fixes,
                          log_to=log_to, rewind=rewind, scheduler=scheduler, log_rows=opts.log_rows,
                          save_report=opts.save_report)
        live = LiveWatch(watch)
        self.state.watches.append(live)
        return live

    @staticmethod
    def _watch_config(opts) -> Any:
        """--config SECTION.FIELD=VALUE, as nbguard.WatchConfig; a bad one names what was wrong."""
        from ..watcher.core.config import WatchConfig

        try:
            return WatchConfig.from_assignments(opts.config)
        except (TypeError, ValueError) as err:
            raise MagicError(f"%nanwatch --config: {err}") from None

    def _rewind_options(self, opts, policy: str, target) -> tuple[Any, Any]:
        """(RewindSettings, the plain loop's scheduler) from --every, --lr-factor, --max-rewinds, --schedule and
        --scheduler; an option that only rewind reads, given under another policy, is an error, not ignored."""
        given = {flag: value for flag, value in (("--every", opts.every), ("--lr-factor", opts.lr_factor),
                                                 ("--max-rewinds", opts.max_rewinds), ("--schedule", opts.schedule))
                 if value is not None}
        if given and policy != "rewind":
            raise MagicError(f"{', '.join(given)} set(s) how policy rewind works, and the policy here is {policy}: "
                             "add --policy rewind, or drop it")
        scheduler = None
        if opts.scheduler:
            if R.is_trainer(target):
                raise MagicError("--scheduler is for a plain loop; a Trainer brings its own LR scheduler")
            scheduler = R.lookup(self.ns, opts.scheduler)
            if not hasattr(scheduler, "state_dict") or not hasattr(scheduler, "get_last_lr"):
                raise MagicError(f"--scheduler {opts.scheduler!r} is a {R.describe(scheduler)}, not an LR scheduler "
                                 "(torch.optim.lr_scheduler)")
        if policy != "rewind":
            return None, scheduler
        from ..watcher import RewindSettings

        fields = {"every": opts.every, "lr_factor": opts.lr_factor, "max_rewinds": opts.max_rewinds,
                  "schedule": opts.schedule}
        try:
            return RewindSettings(**{k: v for k, v in fields.items() if v is not None}), scheduler
        except ValueError as err:  # the settings' own checks, named by the flag the user typed
            raise MagicError(str(err).replace("RewindSettings.", "--").replace("_", "-")) from None

    def _optimizer_for(self, model, name: str | None):
        if name:
            optimizer = self._named(name, R.is_optimizer, "a torch.optim.Optimizer")
            if not R.optimizes(optimizer, model):
                raise MagicError(f"--optimizer {name!r} updates none of this model's parameters; name the optimizer "
                                 "created over this model's parameters")
            return optimizer
        owning = R.candidates(self.ns, lambda o: R.is_optimizer(o) and R.optimizes(o, model))
        found = R.unique(owning, "optimizers over this model", "name one: --optimizer NAME")
        if found is None:
            raise MagicError("a model needs its optimizer: create it first, or name it with --optimizer NAME")
        return found[1]

    def _named(self, name: str, predicate, what: str):
        obj = R.lookup(self.ns, name)
        if not predicate(obj):
            raise MagicError(f"{name!r} is a {R.describe(obj)}, expected {what}")
        return obj

    def _unique_optional(self, predicate, what: str, hint: str):
        found = R.unique(R.candidates(self.ns, predicate), what, hint)
        return found[1] if found else None

    # -- %nbguard fix / report / explain ---------------------------------------------------------
    @magic_arguments()
    @argument("command", choices=NBGUARD_COMMANDS,
              help="fix: put a fix's cell below (with your variable names); report: write everything this "
                   "session recorded to a file; explain: diagnose the last exception again; export-check: "
                   "compare the trained model with what you saved or merged; config: the watch's components and "
                   "the settings %%nanwatch --config takes; help: what happened so far and the one fix to make")
    @argument("value", nargs="?", metavar="ID_OR_PATH",
              help="fix: the fix id (nbguard.fixes.available()); report: the file, ending .html, .md or .json; "
                   "export-check: the trained model or Trainer, by its notebook name")
    @argument("exported", nargs="?", metavar="EXPORTED",
              help="export-check only: the folder save_pretrained wrote, or the name of a model object (a merge)")
    @argument("--apply", action="store_true",
              help="fix only: also run the fix now, on the objects your notebook names")
    @argument("--force", action="store_true",
              help="fix --apply only: apply a cell that was not enough on the failing step anyway")
    @line_magic
    def nbguard(self, line: str = ""):
        """nbguard's fixes, reports and the explainer, from a notebook cell.

        Examples::

            %nbguard fix upcast-trainable-fp32          # the fix as a new cell below this one
            %nbguard fix disable-use-cache --apply      # ...and applied now
            %nbguard report nbguard-report.html
            %nbguard explain
            %nbguard export-check model out/adapter     # is the saved adapter the model you trained?
            %nbguard config                             # what %nanwatch --config SECTION.FIELD=VALUE takes
            %nbguard help                               # what happened, and the one recommended fix
        """
        return self._guarded("nbguard", self._nbguard, line)

    def _nbguard(self, line: str) -> None:
        opts = _parse(self.nbguard, line)
        if opts.apply and opts.command != "fix":
            raise MagicError("--apply goes with %nbguard fix ID")
        if opts.force and not opts.apply:
            raise MagicError("--force goes with %nbguard fix ID --apply (it applies a cell that was not enough)")
        if opts.exported and opts.command != "export-check":
            raise MagicError(f"%nbguard {opts.command} takes one argument (got {opts.exported!r} too)")
        if opts.command == "fix":
            if not opts.value:
                raise MagicError("which fix? %nbguard fix ID [--apply]; ids: nbguard.fixes.available()")
            self._fix(opts.value, opts.apply, opts.force)
        elif opts.command == "report":
            if not opts.value:
                raise MagicError("where to? %nbguard report PATH (.html, .md or .json)")
            self._report(opts.value)
        elif opts.command == "export-check":
            if not (opts.value and opts.exported):
                raise MagicError("%nbguard export-check MODEL EXPORTED: the trained model (or Trainer) and the folder "
                                 "save_pretrained wrote, or the name of the merged model")
            self._export_check(opts.value, opts.exported)
        elif opts.command == "config":
            if opts.value:
                raise MagicError(f"%nbguard config takes no argument (got {opts.value!r})")
            from ..watcher.core.config import describe_sections

            say("%nanwatch --config SECTION.FIELD=VALUE (nbguard.WatchConfig(SECTION={FIELD: VALUE})):")
            say("\n".join(f"  {line}" for line in describe_sections()))
        elif opts.command == "help":
            if opts.value:
                raise MagicError(f"%nbguard help takes no argument (got {opts.value!r})")
            say(self._help())
        else:
            if opts.value:
                raise MagicError(f"%nbguard explain takes no argument (got {opts.value!r})")
            self._explain_last()

    @staticmethod
    def _help() -> str:
        """The commands, then the session's story as the report's headline tells it: what went wrong, where,
        and the one fix to make (``document.view.story_fix``: the story's own choice, read from the report's
        data), with the command that applies it."""
        from .. import api, fixes
        from ..document.view import story_fix, view

        lines = ["nbguard: %nbguard fix ID [--apply [--force]] | report PATH | explain | export-check MODEL EXPORTED "
                 "| config | help; %precision_check audits, %%nanwatch watches a training cell"]
        doc = api.report().to_dict()
        story = view(doc).section("story")
        if story is None:
            return "\n".join([*lines, "Nothing went wrong yet in this session: no audit finding, no watch event."])
        lines += [f"  {fact.text}" for fact in story.facts]
        recommended = story_fix(doc)
        if recommended is not None and recommended.id in fixes.FIXES:  # a fix %nbguard fix can put in a cell
            lines.append(f"Recommended fix: {recommended.id}: %nbguard fix {recommended.id} --apply (or without "
                         "--apply to insert its cell)")
        return "\n".join(lines)

    def _export_check(self, name: str, exported_name: str) -> None:
        import os

        from IPython.display import display

        from .. import api

        target = R.lookup(self.ns, name)
        if not (R.is_trainer(target) or R.is_model(target)):
            raise MagicError(f"{name!r} is a {R.describe(target)}; export-check takes the trained model or its Trainer")
        trainer = target if R.is_trainer(target) else None
        exported: Any = self.ns[exported_name] if exported_name.isidentifier() and exported_name in self.ns \
            else os.path.expanduser(exported_name)
        if isinstance(exported, str) and not os.path.isdir(exported):
            raise MagicError(f"{exported_name!r} is neither a folder nor a variable of this notebook: give the folder "
                             "save_pretrained wrote, or the name of the merged model")
        try:
            result = api.check_export(trainer.model if trainer is not None else target, exported, trainer=trainer)
        except (TypeError, ValueError) as err:
            raise MagicError(str(err)) from None
        display(result)

    def _report(self, path: str) -> None:
        from .. import api
        from ..reporting.report import FORMATS

        suffix = "." + path.rsplit(".", 1)[-1].lower() if "." in path else ""
        if suffix not in FORMATS:
            raise MagicError(f"cannot tell the report format from {path!r}: end it with {', '.join(FORMATS)}")
        try:
            api.report().save(path)
        except OSError as err:
            raise MagicError(f"could not write {path!r}: {err.strerror or err}") from None
        say(f"nbguard: report written to {path}")

    def _fix(self, fix_id: str, apply_now: bool, force: bool = False) -> None:
        from .. import fixes  # local: %load_ext stays light
        from ..fixes.parts import missing_part
        from ..fixes.refusal import FixNotEnough, refusal
        from ..fixes.registry import Target
        from ..fixes.summary import changed_summary

        try:
            fix = fixes.get(fix_id)
        except (KeyError, ValueError) as err:
            raise MagicError(str(err.args[0] if err.args else err)) from None
        names = self.state.names_for_fixes()
        audit = self.state.last_audit
        # the variant for the session's target (the hardware named to the audit), never another one
        options = audit.fix_options(fix_id) if audit is not None else fix.options_for(SESSION.target_hardware)
        objects = self._fix_objects(fix, names) if apply_now else {}
        try:
            code = fixes.code(fix_id, **names, **options)
        except ValueError as err:  # the cell needs a name the notebook does not have
            raise MagicError(f"{err.args[0]}; no such variable in the notebook") from None
        say(cell_verdict_line(fix_id, options, code, names))
        if apply_now:
            refused = None if force else refusal(fix_id, code, python=False)
            if refused is not None:  # this very cell left the failing step failing: say why, and what instead
                raise MagicError(refused)
            try:
                applied = fixes.apply(fix_id, **objects, names=names, force=force, **options)
            except FixNotEnough as err:  # (apply's own cell, when it names the objects otherwise)
                raise MagicError(str(err)) from None
            except (TypeError, ValueError) as err:  # the fix's own checks of the objects it was given
                raise MagicError(f"{fix_id} cannot apply here: {err}") from None
            # one line, counted ("28 float16 -> float32"); every change is in nbguard.fixes.apply's result, and
            # nothing changed says why when the model lacks the part the fix changes
            lacks = None if applied.changed else missing_part(fix, Target(**{k: v for k, v in objects.items()
                                                                            if k != "scaler"}))
            say(f"nbguard: applied {fix_id}: {changed_summary(applied.changed)}" + (f" ({lacks})" if lacks else ""))
        put_next_cell(code, self.ip)  # headless (nbclient): printed, saying it was not inserted

    def _fix_objects(self, fix, names: dict[str, str]) -> dict[str, Any]:
        """Every object the fix acts on, looked up by the notebook's names; a missing one is named."""
        from ..fixes.parts import not_offered
        from ..fixes.registry import Target

        objects = {key: R.lookup(self.ns, name) for key, name in names.items()
                   if key in ("model", "trainer", "args", "tokenizer", "optimizer", "scaler")}
        if not fix.reached_by(objects):
            have = ", ".join(f"{key} {name!r}" for key, name in names.items()) or "none nbguard can name"
            why = not_offered(fix, Target(**{k: v for k, v in objects.items() if k != "scaler"}))
            raise MagicError(f"{why or fix.id + ' acts on ' + fix.need.wanted} (this notebook's: {have}); if one "
                             "exists, name it to %precision_check first so nbguard knows it")
        return objects

    def _explain_last(self) -> None:
        exc = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
        if exc is None:
            raise MagicError("no exception to explain yet in this session")
        if self.state.handler.explain(exc) is None:
            from ..explainer import exception_text

            shown = outward_text(exception_text(exc))[:200]  # redacted whole, then cut, like every shown text
            say(f"nbguard: no known signature in the last exception ({shown})")
