"""Lightning: a ``Callback`` that watches the LightningModule while ``trainer.fit`` runs.

Lightning builds the optimizers and LR schedulers inside ``fit`` (``configure_optimizers``), after the
callbacks are given: the watch is attached at ``on_fit_start``, when the strategy has set them up, with
Lightning's own optimizer, the scheduler that steps it and the mixed-precision GradScaler (16-mixed).
Automatic optimization steps with ``optimizer.step(closure)`` and manual optimization with
``opt.step()``; both reach the torch optimizer's step hooks, where the watch reads and judges each step.

The watch's root is the module ``training_step`` calls: the LightningModule itself when it calls
``self(batch)``, else the submodule named by ``module=``. The root's forward is where micro-batches are
captured and replayed to name a NaN's module; a root that no training step calls is said at the end of
the first step. The watch is detached when ``fit`` ends, normally or not; the callback keeps it
(``callback.watch``) for its events and report.
"""
from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from ...document.outward import outward_text, warn

_PACKAGES = ("lightning.pytorch", "pytorch_lightning")  # Lightning 2's unified package, then the standalone one


def callback_base() -> type:
    """The ``Callback`` class of the Lightning package the user trains with: the one already imported
    (a Trainer accepts only its own package's callbacks), else the first installed."""
    imported = [name for name in _PACKAGES if name in sys.modules]
    for name in imported or _PACKAGES:
        try:
            module = __import__(name, fromlist=["Callback"])
        except ImportError:
            continue
        return module.Callback
    raise ImportError("nbguard.lightning_callback() needs Lightning: pip install lightning")


class TrainingCalls:
    """Counts the training forwards of one module (a forward pre-hook, removed after the first step)."""

    def __init__(self, module: Any):
        self.count = 0
        self._handle = module.register_forward_pre_hook(self._called)

    def _called(self, module: Any, args: Any) -> None:
        if module.training:
            self.count += 1

    def remove(self) -> None:
        self._handle.remove()


class LightningWatchHooks:
    """The callback's hooks (mixed into the package's ``Callback`` by :func:`lightning_callback`).

    ``attach(root, optimizer=, scaler=, scheduler=)`` is ``nbguard.watch`` with the user's options."""

    def __init__(self, attach: Callable[..., Any], module: str | None = None, to_logger: bool = False):
        if module is not None and not isinstance(module, str):
            raise TypeError(f"module must be the name of the submodule training_step calls (e.g. 'model'), "
                            f"got {type(module).__name__}")
        self._attach = attach
        self.module = module
        self.to_logger = to_logger  # log_to="lightning": the tracker behind the Trainer's logger
        self.watch: Any = None
        self._root_calls: TrainingCalls | None = None

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self.watch = None
        optimizers = list(trainer.optimizers)
        if len(optimizers) != 1:
            warn(f"nbguard: this LightningModule trains with {len(optimizers)} optimizers; the watch judges one "
                 f"optimizer's steps against the gradients of the whole model, so it is not attached "
                 f"(call nbguard.watch(submodule, optimizer=opt) in your module for the one to watch)",
                 RuntimeWarning, stacklevel=2)
            return
        optimizer = optimizers[0]
        root = pl_module.get_submodule(self.module) if self.module else pl_module
        steps = dict(optimizer=optimizer, scaler=getattr(trainer.precision_plugin, "scaler", None),
                     scheduler=scheduler_of(trainer, optimizer))
        self.watch = self._attach_logging(trainer, root, steps) if self.to_logger else self._attach(root, **steps)
        self._root_calls = TrainingCalls(root)

    def _attach_logging(self, trainer: Any, root: Any, steps: dict[str, Any]) -> Any:
        """The watch, sending to the tracker behind the Trainer's logger; one nbguard cannot write to (a
        CSVLogger, no logger) is said, and the watch attaches without it (its events stay local)."""
        logger = getattr(trainer, "logger", None)
        tracker = getattr(logger, "experiment", None) if logger is not None else None
        if tracker is not None:
            try:
                return self._attach(root, log_to=tracker, **steps)
            except TypeError as exc:  # refused before anything attached: a tracker nbguard has no sink for
                why = str(exc).split(";")[0]
        else:
            why = "this Trainer has no logger"
        warn(f"nbguard: log_to='lightning' found no tracker to write to ({why}); the events stay in the watch "
             f"(callback.watch, nbguard.report())", RuntimeWarning, stacklevel=3)
        return self._attach(root, **steps)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        calls, self._root_calls = self._root_calls, None
        if calls is None:
            return
        calls.remove()
        if calls.count == 0:
            where = f"pl_module.{self.module}" if self.module else "the LightningModule itself (self(batch))"
            warn(f"nbguard: training_step did not call {where}, so the watch reads each step's gradients but "
                 f"cannot capture its batches: a NaN's module and the step's loss are not named. Call self(x) in "
                 f"training_step, or pass nbguard.lightning_callback(module='<the submodule it calls>')",
                 RuntimeWarning, stacklevel=2)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self._detach()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._detach()

    def _detach(self) -> None:
        if self._root_calls is not None:
            self._root_calls.remove()
            self._root_calls = None
        if self.watch is not None:
            self.watch.detach()

    def __repr__(self) -> str:
        return outward_text(f"<nbguard Lightning callback: {'watching' if self.watch is not None else 'not attached'}>")


def scheduler_of(trainer: Any, optimizer: Any) -> Any:
    """The LR scheduler Lightning steps for ``optimizer`` (the rewind policy's LR cut reaches it), or None."""
    for config in getattr(trainer, "lr_scheduler_configs", ()):
        scheduler = getattr(config, "scheduler", None)
        if getattr(scheduler, "optimizer", None) is optimizer and callable(getattr(scheduler, "step", None)):
            return scheduler
    return None


_CLASSES: dict[type, type] = {}


def lightning_callback(attach: Callable[..., Any], module: str | None = None, to_logger: bool = False) -> Any:
    """A Lightning ``Callback`` (of the package in use) that attaches ``attach`` at ``fit``'s start."""
    base = callback_base()
    cls = _CLASSES.get(base)
    if cls is None:
        cls = _CLASSES[base] = type("NbguardCallback", (LightningWatchHooks, base),
                                    {"__module__": __name__, "__doc__": LightningWatchHooks.__doc__})
    return cls(attach, module, to_logger)
