"""The audit rules, grouped by theme; importing this package registers them all."""
from . import attention, batch, cache, embeddings, precision, tied, tokens, training  # noqa: F401  (registration side effect)
