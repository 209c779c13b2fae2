"""The watch across ranks (DDP, FSDP2) through the process group the run already has.

Per optimizer step every rank folds three flags into its one read — its local loss non-finite,
its local gradients non-finite, its watch stepping aside — and its count of supervised tokens (how
the ranks' losses weigh against each other, :mod:`.rank_tokens`), plus, for sharded (FSDP2) gradients,
its per-group squared shard norms. ONE ``all_reduce(SUM)`` of those few floats is the only extra
collective of a healthy step; the result comes back in the same host read as the rest.

Why the flags are "pre-reduce": under DDP the sentinel reads each gradient bucket in DDP's
communication hook, before it is reduced (:mod:`.ddp_buckets`); where it cannot register that hook,
its ``register_post_accumulate_grad_hook`` runs inside ``AccumulateGrad`` before DDP's reducer hook
(a post-hook of that node) copies the gradient into its bucket. Either way the norm is this rank's
own gradient, before the all-reduce averages a NaN into every rank. Under FSDP2 the per-parameter
hook runs after the reduce-scatter, on the reduced shard (the whole gradient's norms, summed across
ranks); each rank's own gradient is read before it on FSDP's unsharded parameters
(:mod:`.fsdp_grads`, ``RankSync.pre_reduce``). Where this torch's FSDP does not allow that, the flag
is the reduced shard's, and a non-finite gradient is caught without naming its rank.

On a bad step the bad ranks localise their own micro-batches on the unwrapped module (no DDP
forward, so no collective inside the replay); then ``all_gather_object`` (bad steps only) gives
every rank every rank's finding, and all build the same event naming the origin rank. The policy is
decided from the agreed flags, so every rank skips, or every rank stops, at the same step.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

LOSS, GRADS, LEAVING, TOKENS = 0, 1, 2, 3
# evidence an agreed event carries (a later event built from it, e.g. a skip streak's alarm, keeps them)
RANK_EVIDENCE = ("world_size", "bad_ranks", "loss_bad_ranks", "grads_bad_ranks", "by_rank", "note", "own_gradient")
FLAGS = 4  # floats per rank in the exchanged vector


_SERIAL = 0


def _default_store() -> Any:
    """The default process group's store, or None where this torch does not expose it."""
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:  # a private helper of torch: absent or changed, fall back to trusting the ranks
        return None


_AT_COLLECTIVE: dict[int, int] = {}  # collectives so far -> watches this rank attached there


def _collectives_so_far() -> int | None:
    """How many collectives the default process group has run (the same on every rank between the same
    two collectives); None where this torch does not say (then the watches pair by count)."""
    try:
        from torch.distributed.distributed_c10d import _get_default_group

        return int(_get_default_group()._get_sequence_number_for_group())  # type: ignore[attr-defined]
    except Exception:  # a private method of torch's process groups: absent or changed
        return None


def _attached_at(collectives: int) -> int:
    """The n-th watch this rank attaches after ``collectives`` collectives (two models watched back to back)."""
    _AT_COLLECTIVE[collectives] = _AT_COLLECTIVE.get(collectives, 0) + 1
    return _AT_COLLECTIVE[collectives]


def _stored(store: Any, key: str) -> bool:
    """Set ``key`` and return once the store holds it. TCPStore's set only sends (no reply): under load
    its server could answer a peer's check before reading the set, and that peer would watch alone while
    this rank waits in the exchange. A check on the same connection is answered after the set."""
    try:
        store.set(key, "1")
        return bool(store.check([key]))
    except Exception:  # a store that fails: the ranks are trusted to all watch, as without one
        return False


def process_group_ready() -> bool:
    """True inside a multi-rank run whose default process group is initialised."""
    try:
        import torch.distributed as dist
    except ImportError:  # builds without distributed support
        return False
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP2 parameters and gradients); any other tensor as is."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def is_sharded(params: Sequence[torch.Tensor]) -> bool:
    return any(callable(getattr(p, "to_local", None)) for p in params)


def needs_parameter_hooks(target: Any, params: Sequence[torch.Tensor]) -> bool:
    """Whether the sentinel needs a hook per parameter: sharded (FSDP2) gradients, or a DeepSpeed
    engine, which moves gradients into its own buffers (``param.grad`` stays empty at the step
    boundary). Multi-rank DDP starts with them too (``RankSync``: the step boundary sees the averaged
    gradient, and each rank's own one only exists before the all-reduce) until the watch reads DDP's
    buckets instead (``ddp_buckets``)."""
    from .deepspeed_engine import find_engine

    trainer_deepspeed = bool(getattr(target, "is_deepspeed_enabled", False))
    return trainer_deepspeed or find_engine(target) is not None or is_sharded(params)


@dataclass
class RankVerdict:
    """What every rank learned from the step's exchange (identical on every rank)."""

    loss_bad: list[int] = field(default_factory=list)
    grads_bad: list[int] = field(default_factory=list)
    leaving: list[int] = field(default_factory=list)
    tokens: list[float] = field(default_factory=list)  # each rank's supervised tokens this step (-1: unknown)
    # FSDP2: the gradient flags are of the reduced shards (every rank's alike), not each rank's own
    grads_after_reduce: bool = False

    @property
    def bad_ranks(self) -> list[int]:
        return sorted(set(self.loss_bad) | set(self.grads_bad))


class RankSync:
    """This rank's place in the process group and the one small collective per step."""

    def __init__(self, n_groups: int, sharded: bool):
        import torch.distributed as dist

        self.dist = dist
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.sharded = sharded
        self.n_groups = n_groups
        self.owes_farewell = False  # this rank's watch failed: it still joins one exchange, saying so
        self.exchanges = 0
        self.step_exchanged = False  # this step's collective is done (reset at each step's end)
        self.serial: int | str = 0  # set by announce(): what pairs this watch with the other ranks'
        self._store: Any = None
        self.pre_reduce: Any = None  # FSDP2: a fsdp_grads.PreReduceGrads, this rank's own gradients

    @property
    def reads_own_grads(self) -> bool:
        """The GRADS flag is this rank's own gradient (DDP's buckets or hooks; FSDP2's unsharded ones)."""
        return not self.sharded or (self.pre_reduce is not None and self.pre_reduce.available)

    @classmethod
    def detect(cls, params: Sequence[torch.Tensor], n_groups: int) -> RankSync | None:
        if not process_group_ready():
            return None
        return cls(n_groups, is_sharded(params))

    # ---- are all ranks watching? (a watch on rank 0 only must not wait for peers in a collective)
    def _store_key(self, rank: int) -> str:
        return f"nbguard/watch/{self.serial}/{rank}"

    def announce(self) -> None:
        """Say through the process group's key-value store (no collective) that this rank watches
        (at attach; again on a re-attach, harmlessly).

        The watches of the ranks pair by where they attach in the group's sequence of collectives
        (every rank passes the same collectives in the same order; the n-th watch attached between the
        same two collectives pairs with the n-th of the others). A count of watches alone paired a
        watch attached on rank 0 only with the next one rank 1 attached, which then waited in a
        collective for a peer that never joined."""
        global _SERIAL
        if self.serial:
            return
        _SERIAL += 1
        collectives = _collectives_so_far()
        self.serial = _SERIAL if collectives is None else f"c{collectives}.{_attached_at(collectives)}"
        self._store = _default_store()
        if self._store is not None:
            self._store = self._store if _stored(self._store, self._store_key(self.rank)) else None

    def all_ranks_watch(self) -> bool:
        """Checked once, at the first step's read: by then DDP's gradient all-reduce has made every
        rank that watches attach (watches attach before the first forward)."""
        if self._store is None:
            return True  # no store to ask: trust that every rank watches
        return bool(self._store.check([self._store_key(r) for r in range(self.world_size)]))

    @property
    def size(self) -> int:
        return FLAGS * self.world_size + (self.n_groups if self.sharded else 0)

    def exchange(self, norms: torch.Tensor, loss: torch.Tensor | None, leaving: bool = False,
                 tokens: torch.Tensor | None = None) -> torch.Tensor:
        """The step's collective: flags, token counts (and sharded squared norms) summed over ranks, not read yet."""
        vec = torch.zeros(self.size, device=norms.device, dtype=torch.float32)
        at = FLAGS * self.rank
        vec[at + TOKENS] = tokens.to(vec.device, torch.float32) if tokens is not None else -1.0
        if loss is not None:
            vec[at + LOSS] = (~torch.isfinite(loss)).any().float()
        if self.sharded and self.reads_own_grads and not leaving:
            vec[at + GRADS] = self.pre_reduce.flag(norms.device)  # before the reduce-scatter
        else:
            vec[at + GRADS] = (~torch.isfinite(norms)).any().float()
        vec[at + LEAVING] = float(leaving)
        if self.sharded:
            vec[FLAGS * self.world_size:] = norms.square()
        self.dist.all_reduce(vec)
        self.exchanges += 1
        self.step_exchanged = True
        return vec

    def finite_on_every_rank(self, exchanged: torch.Tensor) -> torch.Tensor:
        """1.0 where no rank's own loss or gradients were non-finite, from the step's exchanged (not yet read)
        flags: a 0-d device tensor, the same on every rank (``read="deferred"``: every rank's fused optimizer
        skips the same update, with no host read)."""
        flags = exchanged[:FLAGS * self.world_size].view(self.world_size, FLAGS)[:, LOSS:GRADS + 1]
        return (flags == 0).all().float()

    def farewell(self, device: torch.device) -> None:
        """Join this step's exchange once more, flagged as leaving, so no peer waits for it."""
        self.owes_farewell = False
        self.exchange(torch.zeros(self.n_groups, device=device), None, leaving=True)

    def verdict(self, values: list[float]) -> RankVerdict:
        def ranks(slot: int) -> list[int]:
            return [r for r in range(self.world_size) if values[FLAGS * r + slot] != 0]

        return RankVerdict(ranks(LOSS), ranks(GRADS), ranks(LEAVING),
                           [values[FLAGS * r + TOKENS] for r in range(self.world_size)])

    def settle(self, stats: Any) -> RankVerdict:
        """Read the exchange out of a step's ``StepStats``; sharded runs get whole-gradient norms."""
        values = stats.exchanged
        verdict = self.verdict(values)
        if self.sharded:
            reduced = [math.sqrt(v) if v >= 0 else math.nan for v in values[FLAGS * self.world_size:]]
            stats.grad_norm = [v / stats.loss_scale for v in reduced] if stats.loss_scale else reduced
            verdict.grads_after_reduce = not self.reads_own_grads
            if not verdict.bad_ranks and not all(math.isfinite(v) for v in reduced):
                # every rank's own gradient read finite, the reduced one is not (a parameter the read
                # does not see, or the sum overflowed): still a bad step, of no one rank
                verdict.grads_bad, verdict.grads_after_reduce = list(range(self.world_size)), True
        return verdict

    def smallest(self, value: int, device: torch.device) -> int:
        """The smallest of every rank's ``value``: one small collective. Every rank must call it at the
        same point (policy rewind: where to go back to, whether a snapshot is taken)."""
        vec = torch.tensor([float(value)], device=device, dtype=torch.float64)
        self.dist.all_reduce(vec, op=self.dist.ReduceOp.MIN)
        return int(vec.item())

    def gather(self, local: dict[str, Any] | None) -> list[dict[str, Any] | None]:
        """Every rank's localisation (bad steps only): one object collective, same order on all ranks."""
        out: list[Any] = [None] * self.world_size
        self.dist.all_gather_object(out, local)
        return out


def _origin_rank(verdict: RankVerdict, found: list[dict[str, Any] | None]) -> int | None:
    """The rank a bad step is about: of the ranks that localised a module, one whose own loss was
    non-finite, then one whose origin is in forward (a forward overflow comes before any backward
    one it causes), then the lowest; else the first whose own loss was non-finite, else the first
    whose own gradients were (None when every rank's were, or the flags are of FSDP's reduced shards)."""
    def forward_first(r: int) -> tuple[bool, bool, int]:
        phase = (found[r] or {}).get("origins", [{}])[0].get("phase")
        return r not in verdict.loss_bad, phase != "forward", r

    localised = [r for r, f in enumerate(found) if f and f.get("origins")]
    if localised:
        return min(localised, key=forward_first)
    if verdict.loss_bad:
        return verdict.loss_bad[0]
    if verdict.grads_bad and len(verdict.grads_bad) < len(found):
        return verdict.grads_bad[0]
    return None


def agreed_event(sync: RankSync, verdict: RankVerdict, step: int, localise: Callable[[], Any]) -> Any:
    """The same event on every rank: bad ranks localise (``localise()`` builds this rank's event),
    one ``all_gather_object`` shares the findings, the origin rank's finding becomes the event.
    Every rank must call it at the same step (the verdict and scaler state they decide on agree)."""
    from ...findings import Event

    local: dict[str, Any] | None = None
    # the ranks whose own contribution was bad localise; when none was (a scale collapse seen only
    # by the scaler), rank 0 speaks for all
    if sync.rank in (verdict.bad_ranks or [0]):
        try:
            local = localise().to_dict()
        except Exception as exc:  # the gather below must still happen, or the peers would wait
            local = {"kind": "nonfinite-loss" if sync.rank in verdict.loss_bad else "nonfinite-grad",
                     "step": step, "message": "non-finite values (this rank's localisation failed)",
                     "evidence": {"replay_error": f"{type(exc).__name__}: {exc}"}}
        if sync.pre_reduce is not None and sync.rank in verdict.grads_bad and not verdict.grads_after_reduce:
            _add_own_gradient(local, sync.pre_reduce)
    found = sync.gather(local)
    origin = _origin_rank(verdict, found)
    made = [f for f in found if f]  # at least one: the bad ranks, or rank 0, always make one
    chosen = (found[origin] if origin is not None else None) or made[0]
    event = Event.from_dict(chosen)
    event.step = step
    event.rank = origin
    if origin is not None:
        event.message = f"rank {origin}: {event.message}"
    elif verdict.bad_ranks:  # (FSDP2's own read: each of these ranks' own gradient was non-finite)
        after = " (after the reduction)" if not sync.sharded or verdict.grads_after_reduce else ""
        event.message = f"ranks {verdict.bad_ranks}{after}: {event.message}"
    event.evidence.update({
        "world_size": sync.world_size, "bad_ranks": verdict.bad_ranks, "loss_bad_ranks": verdict.loss_bad,
        "grads_bad_ranks": verdict.grads_bad, "reported_by_rank": sync.rank,
        # the other bad ranks' own findings, so a second origin is not lost
        "by_rank": {str(r): {k: f.get(k) for k in ("kind", "cause", "origins")}
                    for r, f in enumerate(found) if f and r != origin},
    })
    if sync.sharded and origin is None and verdict.grads_after_reduce:
        event.evidence["note"] = _reduced_note(sync)
    return event


def _add_own_gradient(local: dict[str, Any], reader: Any) -> None:
    """FSDP2 (no replay there): where this rank's own gradient went non-finite, read before the reduction."""
    try:
        found = reader.findings()
    except Exception as exc:  # the gather must still happen
        found = {"error": f"{type(exc).__name__}: {exc}"}
    if found:
        local.setdefault("evidence", {})["own_gradient"] = found


def _reduced_note(sync: RankSync) -> str:
    """Why a sharded run's bad gradient names no rank."""
    missing = sync.pre_reduce.missing if sync.pre_reduce is not None else "no reader"
    if missing is not None:
        return (f"FSDP reduces gradients before the watch sees them, and each rank's own gradient could not "
                f"be read first ({missing}): every rank's shard is non-finite, and no rank's own loss was, "
                f"so the rank cannot be told")
    return ("every rank's own gradient read finite before FSDP's reduce-scatter, the reduced one did not (a "
            "parameter outside FSDP's groups, or an overflow in the reduction): the rank cannot be told")
