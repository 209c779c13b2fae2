"""The audit rules, grouped by theme; importing this package registers them all."""
from . import accumulation, batch, cache, embeddings, labels, padding, precision, training  # noqa: F401  (registers them)
