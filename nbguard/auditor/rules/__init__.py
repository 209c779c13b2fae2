"""The audit rules, grouped by theme; importing this package registers them all."""
from . import batch, cache, embeddings, precision, quantization, training  # noqa: F401  (registration side effect)
