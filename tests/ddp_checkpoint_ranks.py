"""One rank of a two-rank gloo run: LoRA + activation checkpointing under DDP(find_unused_parameters=True).

``python -m torch.distributed.run --nproc_per_node 2 tests/ddp_checkpoint_ranks.py MODE OUT_DIR``; MODE is
"reentrant" or "non-reentrant". Each rank audits its model, takes one DDP step, and writes rank{N}.json.
The tests run both modes in one launch, one after the other (ddp_helpers.train_checkpoint_rank, CHECKPOINT_BATCH).
"""
from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import torch


def main(mode: str, out_dir: str) -> None:
    import torch.distributed as dist
    from peft import LoraConfig, get_peft_model
    from torch.nn.parallel import DistributedDataParallel

    import nbguard
    from nbguard.testing import tiny_batch, tiny_llama

    if not dist.is_initialized():  # a scenario before this one in the launch may have started the group
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = get_peft_model(tiny_llama(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": mode == "reentrant"})
    model.enable_input_require_grads()
    model.train()
    found = [f.rule for f in nbguard.audit(model).findings]
    ddp = DistributedDataParallel(model, find_unused_parameters=True)  # what the Trainer picks for a PEFT model
    error = None
    try:
        ddp(**tiny_batch(2, 12, seed=rank)).loss.backward()
    except RuntimeError as exc:
        error = str(exc)
    diagnosis = nbguard.explain(RuntimeError(error)) if error else None
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({
        "rules": found, "error": error, "signature": diagnosis.signature if diagnosis else None}))
    # Free the DDP wrapper (its reducer) while the process group lives, and leave together: a rank
    # whose reducer was freed after destroy_process_group, its peer gone, hung at exit about once in
    # a few loaded runs here (main thread in teardown, a gloo thread waiting).
    del ddp
    gc.collect()
    dist.barrier()


if __name__ == "__main__":
    import torch.distributed as dist

    torch.set_num_threads(1)
    main(sys.argv[1], sys.argv[2])
    dist.destroy_process_group()
