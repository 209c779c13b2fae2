"""Rules about the token embeddings."""
from __future__ import annotations

from ...introspect.embeddings import embedding_matrices, padding_row, token_deltas, zero_rows
from ..registry import finding, rule


@rule("zero-embedding-rows", "warning")
def zero_embedding_rows(ctx):
    """All-zero rows in the input or output embeddings (new tokens initialised to zero)."""
    if ctx.model is None:
        return None
    seen = {}
    pad = padding_row(ctx.model)
    for name, matrix in embedding_matrices(ctx.model):
        rows = zero_rows(matrix, keep=pad)
        if 0 < len(rows) < matrix.shape[0]:
            seen[name] = rows.tolist()
    for name, adapter, delta, indices in token_deltas(ctx.model):
        rows = zero_rows(delta)
        if len(rows):
            seen[f"{name}.trainable_tokens_delta.{adapter}"] = [indices[i] for i in rows.tolist()]
    if not seen:
        return None
    tokens = sorted({t for rows in seen.values() for t in rows})
    return finding(
        "zero-embedding-rows",
        f"{len(tokens)} token embeddings are all zeros",
        "These rows (typically tokens added with resize_token_embeddings and then zeroed) start at exactly 0: "
        "the input embedding of such a token carries no signal, RMSNorm at a zero vector has a gradient "
        "of 1/sqrt(eps) (about 1,000x, which overflows easily in half precision), and a zero output row gives the token a logit of 0, far above the large negative logits of unused tokens. "
        "Start new rows at the mean of the trained rows instead.",
        {"padding_row_ignored": pad, "matrices": {n: {"rows": r[:10], "count": len(r)} for n, r in seen.items()},
         "token_ids": tokens[:10], "token_count": len(tokens)},
        fixes=["init-new-embeddings"],
    )
