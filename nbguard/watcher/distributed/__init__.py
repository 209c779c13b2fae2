"""Across ranks: the step's agreement, rank token balance, the forked ranks' stream, DDP buckets, FSDP
shards and DeepSpeed."""
