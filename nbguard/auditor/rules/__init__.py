"""The audit rules, grouped by theme; importing this package registers them all."""
from . import (  # noqa: F401  (registers them)
    accumulation,
    attention,
    batch,
    cache,
    embeddings,
    labels,
    padding,
    precision,
    quantization,
    rl,
    tied,
    tokens,
    training,
)
