"""The audit rules, grouped by theme; importing this package registers them all."""
from . import accumulation, attention, batch, cache, embeddings, labels, padding, precision, tied, tokens, training  # noqa: F401  (registers them)
