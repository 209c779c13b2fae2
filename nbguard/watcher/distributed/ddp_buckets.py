"""Under DDP, each rank's own gradient norms from DDP's communication hook, one bucket at a time.

A rank's own gradient exists only before the all-reduce averages it with the others (a NaN on one
rank reaches every rank after it). Without this, the watch takes that gradient with one hook and
one norm per parameter per micro-batch. DDP hands every bucket to a communication hook right before
reducing it: there the bucket's gradients are still this rank's own, accumulated over the step's
micro-batches (``no_sync`` ones included), before clipping and before a GradScaler unscales them.
The hook takes one fused norm per bucket and then reduces exactly as DDP does by default
(torch's ``allreduce_hook``).

DDP takes one communication hook for its life. The watch registers it at attach (a DDP model given
to ``nbguard.watch``) or when ``Trainer.train()`` has wrapped the model, between steps; where DDP
already has a hook (the user's, e.g. fp16 compression), the watch keeps its hook per parameter. A
hook cannot be removed: after detach it only reduces, and a later watch on the same DDP model takes
it over.
"""
from __future__ import annotations

import weakref
from typing import Any

import torch

_READER_ATTR = "_nbguard_bucket_reader"  # on the DDP module: the reader its hook calls


class BucketReader:
    """The DDP module's communication hook: hands each bucket to its reader (``take_bucket(index,
    parameters, gradients)``, which guards itself), then reduces as DDP does by default. The reader is held weakly:
    the DDP module must not keep a watch (and its collector) alive."""

    def __init__(self, process_group: Any):
        self.process_group = process_group
        self._reader: weakref.ref[Any] | None = None

    def point_at(self, reader: Any) -> None:
        """Who reads the buckets from now on (None: nobody; the hook only reduces)."""
        self._reader = weakref.ref(reader) if reader is not None else None

    def reduce(self, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        # (here: torch builds without distributed support must still import the watch)
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        reader = self._reader() if self._reader is not None else None
        if reader is not None:
            try:
                reader.take_bucket(bucket.index(), bucket.parameters(), bucket.gradients())
            except Exception:  # (take_bucket reports its own errors) never break the user's backward
                pass
        return allreduce_hook(self.process_group, bucket)


def bucket_reader(ddp: torch.nn.Module) -> BucketReader | None:
    """The reader on this DDP module's communication hook: nbguard's, registered now if the module has
    none yet; None where another hook is registered (DDP takes one)."""
    reader = getattr(ddp, _READER_ATTR, None)
    if isinstance(reader, BucketReader):
        return reader
    register = getattr(ddp, "register_comm_hook", None)
    if not callable(register):
        return None
    reader = BucketReader(getattr(ddp, "process_group", None))

    # a function, not the reader itself: DDP checks the hook's signature and __name__ (no annotations:
    # DDP compares them with its own types)
    def nbguard_bucket_hook(state, bucket):
        return reader.reduce(bucket)

    try:
        register(state=None, hook=nbguard_bucket_hook)
    except RuntimeError:  # DDP takes one hook: the user's (or accelerate's) is there already
        return None
    setattr(ddp, _READER_ATTR, reader)
    return reader


def find_ddp(target: Any) -> torch.nn.Module | None:
    """The ``DistributedDataParallel`` module of a watch target: the target itself, or the model a
    Trainer has wrapped (``model_wrapped``, set by ``train()``)."""
    from torch.nn.parallel import DistributedDataParallel  # (as in step.eager.user_module)

    for candidate in (target, getattr(target, "model_wrapped", None)):
        if isinstance(candidate, DistributedDataParallel):
            return candidate
    return None
