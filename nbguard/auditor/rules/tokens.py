"""Rules about token ids against the embedding matrix (tokens added without resize_token_embeddings)."""
from __future__ import annotations

import torch

from ...document.view import plural
from ...findings import Finding
from ...introspect.embeddings import embedding_shape
from ..context import AuditContext
from ..registry import capped, finding, rule

IGNORE_INDEX = -100


def _out_of_range(tensor: torch.Tensor | None, rows: int) -> list[int]:
    if not isinstance(tensor, torch.Tensor) or tensor.is_floating_point():
        return []
    ids = tensor[(tensor != IGNORE_INDEX)]
    return sorted(set(ids[(ids >= rows) | (ids < 0)].tolist()))


@rule("token-ids-out-of-range", "error")
def token_ids_out_of_range(ctx: AuditContext) -> Finding | None:
    """Token ids (tokenizer size, batch input_ids or labels) beyond the embedding matrix: tokens added without a resize."""
    if ctx.model is None:
        return None
    shape = embedding_shape(ctx.model)
    if shape is None:
        return None
    rows = shape[0]
    evidence: dict = {"embedding_rows": rows}
    tok = ctx.tokenizer
    if tok is not None and len(tok) > rows:
        evidence["tokenizer_size"] = len(tok)
    # The batch given to the audit, else batches drawn from the Trainer's own dataloader.
    for key in ("input_ids", "labels"):
        bad = sorted({i for batch in ctx.batches for i in _out_of_range(batch.get(key), rows)})
        if bad:
            evidence[f"{key}_out_of_range"] = capped(bad)
    if len(evidence) == 1:
        return None
    if any(k.endswith("_out_of_range") for k in evidence):
        evidence.update(ctx.sample.to_evidence())
    seen = []
    if "tokenizer_size" in evidence:
        seen.append(f"the tokenizer has {evidence['tokenizer_size']} tokens")
    in_batch = any(k.endswith("_out_of_range") for k in evidence)
    if in_batch:
        seen.append("a batch holds ids at or above that")
    # The lookup only fails on an id it is given: batches that were read and hold none make it a risk, not a crash.
    unseen = not in_batch and bool(ctx.batches)
    if unseen:
        seen.append(f"none of the {plural(len(ctx.batches), 'batch', 'es')} read holds such an id yet")
    return finding(
        "token-ids-out-of-range",
        f"token ids beyond the {rows}-row embedding matrix",
        f"The input embedding has {rows} rows but {' and '.join(seen)}: tokens were added to the tokenizer "
        "without model.resize_token_embeddings(len(tokenizer)). On CPU the embedding lookup raises "
        "\"IndexError: index out of range in self\"; on a GPU it is \"CUDA error: device-side assert triggered\" "
        "(srcIndex < srcSelectDimSize), after which the CUDA context is unusable until the kernel restarts. "
        "Resize the embeddings (new rows start at the mean of the trained ones).",
        evidence,
        fixes=["resize-token-embeddings"], severity="warning" if unseen else "error",
    )
