"""One rank of a two-rank gloo run whose rank 1 blocks: the stall heartbeat on real ranks.

``python -m torch.distributed.run --nproc_per_node 2 tests/ddp_stall_ranks.py WHERE OUT_DIR``. Each rank trains a
tiny Llama under DistributedDataParallel in a plain loop fed by a real DataLoader, with ``nbguard.watch``
(``WatchConfig(stall={"after_s": STALL_AFTER_S})``). At batch ``BLOCK_AT`` rank 1 blocks on a key of the process group's own
TCP store (``store.wait``: no sleep, no polling): WHERE ``collate`` in its DataLoader's collate function (rank 0
then waits in DDP's next forward, in its buffer broadcast), ``backward`` between its forward and its backward
(rank 0 then waits in its backward, where DDP all-reduces the gradients). Rank 0's watch listener sets the key once rank 0's ``stall`` event is
recorded, so the block lasts exactly until the event exists, whatever the machine's load. The key is also set
in a ``finally`` on rank 0, and rank 1's wait has a timeout: a missing event shows as a failed assertion
(``released_by_stall`` False), never as hung ranks. Each rank writes what it saw to ``OUT_DIR/rank{N}.json``.
"""
from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path

import torch

STALL_AFTER_S = 0.5  # the floor of the bound: rank 0's event comes about 0.5-1 s into the block
STEPS = 8
BLOCK_AT = 5  # rank 1's collate blocks on this batch (rank 0 completed steps 0-4 and waits for step 5)
RELEASE_KEY = "nbguard-test-stall-release"
BLOCKED_KEY = "nbguard-test-stall-blocked"
RELEASE_TIMEOUT_S = 60.0  # rank 1 gives up waiting after this: no stall event came on rank 0


class Indices(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return STEPS

    def __getitem__(self, index: int) -> int:
        return index


def main(where: str, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store
    from torch.nn.parallel import DistributedDataParallel

    import nbguard
    from nbguard.testing import tiny_batch, tiny_llama

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    store = _get_default_store()
    released: list[bool] = []
    blocked_at_event: list[bool] = []

    def rank1_blocks() -> None:
        store.set(BLOCKED_KEY, "1")
        try:
            store.wait([RELEASE_KEY], timedelta(seconds=RELEASE_TIMEOUT_S))  # blocks: the fault
            released.append(True)
        except Exception:  # the timeout: rank 0 recorded no stall
            released.append(False)

    def rank1_collate(indices):
        (index,) = indices
        if rank == 1 and index == BLOCK_AT and where == "collate":
            rank1_blocks()
        return tiny_batch(2, 12, seed=100 * rank + index)

    def release(watch, kind, payload) -> None:
        # only the stall of the block (a loaded machine may make an earlier one, which must not release it)
        if rank == 0 and kind == "event" and payload.kind == "stall" and payload.evidence["after_step"] == BLOCK_AT - 1:
            # was rank 1 already in its block? (on a loaded machine rank 0 may stall a moment earlier, waiting for a
            # rank 1 that is only slow; rank 1 then finds the key set and does not block: the test runs it again)
            blocked_at_event.append(store.check([BLOCKED_KEY]))
            store.set(RELEASE_KEY, "stall")

    torch.manual_seed(0)
    model = DistributedDataParallel(tiny_llama())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    watch = nbguard.watch(model, optimizer=optimizer, verify=False, log_to=None,
                          config=nbguard.WatchConfig(stall={"after_s": STALL_AFTER_S}))
    watch.add_listener(release)
    data = torch.utils.data.DataLoader(Indices(), batch_size=1, collate_fn=rank1_collate)
    try:
        for index, batch in enumerate(data):
            loss = model(**batch).loss
            if rank == 1 and index == BLOCK_AT and where == "backward":
                rank1_blocks()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    finally:
        if rank == 0:
            store.set(RELEASE_KEY, "finally")
    steps = watch.step
    watch.detach()
    result = {"rank": rank, "steps": steps, "released_by_stall": released[0] if released else None,
              "blocked_at_event": blocked_at_event[0] if blocked_at_event else None,
              "events": [e.to_dict() for e in watch.events]}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    # leave together, the DDP wrapper (its reducer) freed while the process group lives
    del model, optimizer, watch
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
