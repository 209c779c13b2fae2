"""``%precision_check``, ``%nanwatch`` / ``%%nanwatch`` and ``%nbguard``: parse, resolve names, call the core.

Mistakes in a magic's arguments are one line on stderr (``nbguard: ...``), never a traceback.
"""
from __future__ import annotations

import argparse
import shlex
import sys
from typing import Any

from IPython.core.magic import Magics, line_cell_magic, line_magic, magics_class

from . import resolve as R
from .resolve import MagicError

POLICIES = ("warn", "skip", "stop")


class _Parser(argparse.ArgumentParser):
    """argparse that raises :class:`MagicError` instead of printing usage and exiting."""

    def error(self, message):
        raise MagicError(f"%{self.prog}: {message}")

    def exit(self, status=0, message=None):
        if message:
            raise MagicError(message.strip())
        raise MagicError(self.format_usage().strip())


def _parse(parser: argparse.ArgumentParser, line: str) -> argparse.Namespace:
    try:
        return parser.parse_args(shlex.split(line))
    except ValueError as err:  # unbalanced quotes
        raise MagicError(f"%{parser.prog}: {err}") from None


def _precision_parser():
    p = _Parser(prog="precision_check", add_help=False)
    p.add_argument("objects", nargs="*")
    p.add_argument("--hardware", default=None)
    p.add_argument("--probe", action="store_true")
    p.add_argument("--batch", default=None)
    return p


def _nanwatch_parser():
    p = _Parser(prog="nanwatch", add_help=False)
    p.add_argument("target", nargs="?")
    p.add_argument("--policy", choices=POLICIES, default="warn")
    p.add_argument("--optimizer", default=None)
    p.add_argument("--scaler", default=None)
    p.add_argument("--activations", action="store_true")
    p.add_argument("--ranks", action="store_true")  # the ranks a notebook_launcher in this cell forks
    return p


def _nbguard_parser():
    p = _Parser(prog="nbguard", add_help=False)
    sub = p.add_subparsers(dest="command", parser_class=_Parser)
    fix = sub.add_parser("fix", add_help=False)
    fix.add_argument("fix_id")
    fix.add_argument("--apply", action="store_true")
    rep = sub.add_parser("report", add_help=False)
    rep.add_argument("path")
    sub.add_parser("explain", add_help=False)
    return p


@magics_class
class NbguardMagics(Magics):
    def __init__(self, shell, state):
        super().__init__(shell)
        self.state = state  # the extension's state (watches started here, last names, ...)

    @property
    def ns(self) -> dict[str, Any]:
        return self.shell.user_ns

    def _guarded(self, func, *args):
        try:
            return func(*args)
        except MagicError as err:
            print(f"nbguard: {err}", file=sys.stderr)
        except (TypeError, ValueError) as err:  # the core's messages for bad input name the argument
            print(f"nbguard: {err}", file=sys.stderr)
        return None

    # -- %precision_check ------------------------------------------------------------------------
    @line_magic
    def precision_check(self, line: str = ""):
        """%precision_check [OBJ ...] [--hardware NAME] [--probe] [--batch NAME]: audit precision."""
        return self._guarded(self._precision_check, line)

    def _precision_check(self, line: str) -> None:
        from .. import api, fixes

        opts = _parse(_precision_parser(), line)
        targets, names = self._audit_targets(opts.objects)
        batch = None
        if opts.batch:
            batch = R.lookup(self.ns, opts.batch)
            if not R.is_batch(batch):
                raise MagicError(f"--batch {opts.batch!r} is a {R.describe(batch)}, expected a dict of tensors")
        kwargs = dict(targets, batch=batch, hardware=opts.hardware, probe=opts.probe)
        result = api.audit(**kwargs)
        self.state.last_names = names
        self.state.last_audit = result

        def apply(fix_id: str):
            options = result.fix_options(fix_id)
            applied = fixes.apply(fix_id, model=targets.get("model"), trainer=targets.get("trainer"),
                                  args=targets.get("args"), **options)
            return applied.changed, fixes.code(fix_id, **names, **options)

        from .present import show_audit

        show_audit(result, names=names, rerun=lambda: api.audit(**kwargs), apply=apply)

    def _audit_targets(self, given: list[str]) -> tuple[dict[str, Any], dict[str, str]]:
        targets: dict[str, Any] = {}
        names: dict[str, str] = {}
        for name in given:
            obj = R.lookup(self.ns, name)
            kind = ("trainer" if R.is_trainer(obj) else "model" if R.is_model(obj)
                    else "args" if R.is_training_args(obj) else None)
            if kind is None:
                raise MagicError(f"{name!r} is a {R.describe(obj)}; %precision_check takes a Trainer, "
                                 "a torch.nn.Module or TrainingArguments")
            if kind in targets:
                raise MagicError(f"two {kind}s given ({names[kind]} and {name}); audit one at a time")
            targets[kind], names[kind] = obj, name
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
    @line_cell_magic
    def nanwatch(self, line: str = "", cell: str | None = None):
        """%nanwatch [OBJ] [--policy warn|skip|stop] [--optimizer NAME] [--activations]; %nanwatch off; %%nanwatch [OBJ].

        %%nanwatch [--ranks] around ``notebook_launcher(...)`` (``--ranks`` is implied when the cell calls it
        and names no OBJ): the forked ranks, which call ``nbguard.watch`` themselves, stream to one dashboard
        here with a row per rank, and ``%nbguard report`` holds every rank."""
        if cell is None:
            return self._guarded(self._nanwatch_line, line)
        return self._guarded(self._nanwatch_cell, line, cell)

    def _nanwatch_line(self, line: str) -> None:
        if line.strip() == "off":
            if not self.state.watches:
                raise MagicError("no watch started by %nanwatch is running")
            from .display import new_output_id, publish

            for live in self.state.stop_watches():
                publish(dict(live.doc, output_id=new_output_id()))  # the final summary, here where it was switched off
            return
        self._start_watch(line)

    def _nanwatch_cell(self, line: str, cell: str) -> None:
        if line.strip() == "off":
            raise MagicError("%%nanwatch watches the cell it heads; use %nanwatch off on its own line")
        live = self._start_watch(line, cell)
        try:
            self.shell.run_cell(cell, store_history=False)
        finally:
            self.state.stop_watch(live)
            summary = getattr(live.watch, "summary", None)
            if callable(summary):
                print(summary())

    def _start_watch(self, line: str, cell: str | None = None):
        from .. import api
        from .present import LiveWatch

        opts = _parse(_nanwatch_parser(), line)
        if opts.ranks or (cell is not None and not opts.target and "notebook_launcher(" in cell):
            from .ranks import watch_forked_ranks  # nbguard.watch runs inside the forked ranks

            self.state.stop_watches()
            live = watch_forked_ranks()
            self.state.watches.append(live)
            return live
        if opts.target:
            target = R.lookup(self.ns, opts.target)
            if not (R.is_trainer(target) or R.is_model(target)):
                raise MagicError(f"{opts.target!r} is a {R.describe(target)}; %nanwatch takes a Trainer or a torch.nn.Module")
        else:
            _kind, _name, target = self._find_target("%nanwatch")
        optimizer = scaler = None
        if R.is_model(target):
            optimizer = self._optimizer_for(target, opts.optimizer)
            scaler = self._named(opts.scaler, R.is_scaler, "a torch.amp.GradScaler") if opts.scaler else \
                self._unique_optional(R.is_scaler, "GradScalers", "name it: --scaler NAME")
        elif opts.optimizer:
            raise MagicError("--optimizer is for a model; a Trainer brings its own optimizer")
        self.state.stop_watches()  # one %nanwatch at a time: never two watches on the same run
        watch = api.watch(target, optimizer=optimizer, scaler=scaler, policy=opts.policy,
                              activations=opts.activations)
        live = LiveWatch(watch)
        self.state.watches.append(live)
        return live

    def _optimizer_for(self, model, name: str | None):
        if name:
            return self._named(name, R.is_optimizer, "a torch.optim.Optimizer")
        params = {id(p) for p in model.parameters()}
        owning = R.candidates(self.ns, lambda o: R.is_optimizer(o) and any(
            id(p) in params for g in o.param_groups for p in g["params"]))
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
    @line_magic
    def nbguard(self, line: str = ""):
        """%nbguard fix ID [--apply] | %nbguard report PATH | %nbguard explain"""
        return self._guarded(self._nbguard, line)

    def _nbguard(self, line: str) -> None:
        opts = _parse(_nbguard_parser(), line)
        if opts.command == "fix":
            self._fix(opts.fix_id, opts.apply)
        elif opts.command == "report":
            from .. import api

            api.report().save(opts.path)
            print(f"nbguard: report written to {opts.path}")
        elif opts.command == "explain":
            self._explain_last()
        else:
            raise MagicError("usage: %nbguard fix ID [--apply] | %nbguard report PATH | %nbguard explain")

    def _fix(self, fix_id: str, apply_now: bool) -> None:
        from nbguard import fixes

        try:
            fixes.get(fix_id)
        except (KeyError, ValueError) as err:
            raise MagicError(str(err.args[0] if err.args else err)) from None
        names = self.state.names_for_fixes()
        audit = self.state.last_audit
        options = audit.fix_options(fix_id) if audit is not None else {}
        code = fixes.code(fix_id, **names, **options)
        if apply_now:
            targets = {k: R.lookup(self.ns, v) for k, v in names.items() if k in ("model", "trainer")}
            applied = fixes.apply(fix_id, **targets, **options)
            print(f"nbguard: applied {fix_id}: {applied.changed or 'nothing to change'}")
        self.shell.set_next_input(code, replace=False)

    def _explain_last(self) -> None:
        exc = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
        if exc is None:
            raise MagicError("no exception to explain yet in this session")
        if self.state.handler.explain(exc) is None:
            from nbguard.explainer import exception_text

            print(f"nbguard: no known signature in the last exception ({exception_text(exc)[:200]})")
