"""Finding the token-embedding matrices of a model, PEFT wrappers included.

After ``resize_token_embeddings`` the new rows live in the input embedding and (when untied) the
output projection; PEFT may add copies (``modules_to_save``) or per-token deltas
(``trainable_token_indices``). Every matrix shaped (vocab, hidden) is one of them, so shape is the
test, and shared storage (tied weights) is counted once.
"""
from __future__ import annotations

import torch

from .dtypes import QUANTIZED_PARAM_CLASSES


def embedding_shape(model) -> tuple[int, int] | None:
    getter = getattr(model, "get_input_embeddings", None)
    try:
        emb = getter() if callable(getter) else None
    except (NotImplementedError, AttributeError):
        emb = None
    if emb is None:
        return None
    for module in emb.modules():  # the real nn.Embedding inside any PEFT wrapper
        if isinstance(module, torch.nn.Embedding):
            rows, cols = module.weight.shape
            return int(rows), int(cols)
    weight = getattr(emb, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return int(weight.shape[0]), int(weight.shape[1])
    return None


def padding_row(model) -> int | None:
    """The padding token's row: nn.Embedding(padding_idx=...) keeps it at zero on purpose."""
    getter = getattr(model, "get_input_embeddings", None)
    try:
        emb = getter() if callable(getter) else None
    except (NotImplementedError, AttributeError):
        emb = None
    for module in emb.modules() if emb is not None else ():
        if isinstance(module, torch.nn.Embedding) and module.padding_idx is not None:
            return module.padding_idx
    return None


def embedding_matrices(model) -> list[tuple[str, torch.nn.Parameter]]:
    """Every (vocab, hidden) parameter on a real device, shared storage once."""
    shape = embedding_shape(model)
    if shape is None:
        return []
    seen, out = set(), []
    for name, param in model.named_parameters():
        if tuple(param.shape) != shape or param.is_meta or not param.is_floating_point() \
                or type(param).__name__ in QUANTIZED_PARAM_CLASSES:  # a quantised lm_head (torchao): no rows to read
            continue
        key = (param.untyped_storage().data_ptr(), param.storage_offset())
        if key in seen:
            continue
        seen.add(key)
        out.append((name, param))
    return out


def token_deltas(model) -> list[tuple[str, str, torch.nn.Parameter, list[int]]]:
    """PEFT trainable-token layers: (module name, adapter, delta parameter, token indices)."""
    out = []
    for name, module in model.named_modules():
        deltas = getattr(module, "trainable_tokens_delta", None)
        indices = getattr(module, "token_indices", None)
        if not isinstance(deltas, torch.nn.ParameterDict) or not isinstance(indices, dict):
            continue
        if getattr(module, "tied_adapter", None) is not None:
            continue  # shares the delta of the layer it is tied to
        for adapter, delta in deltas.items():
            if adapter in indices and not delta.is_meta:
                out.append((name, adapter, delta, list(indices[adapter])))
    return out


def zero_mask(matrix: torch.Tensor, keep: int | None = None) -> torch.Tensor:
    """A boolean mask of the rows that are exactly zero, except row ``keep`` (the padding row)."""
    mask = (matrix.detach() == 0).all(dim=1)
    if keep is not None and 0 <= keep < mask.shape[0]:
        mask[keep] = False
    return mask


def zero_rows(matrix: torch.Tensor, keep: int | None = None) -> torch.Tensor:
    """Indices of the rows that are exactly zero (the padding row excepted)."""
    return torch.nonzero(zero_mask(matrix, keep)).flatten()
