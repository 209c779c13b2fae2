"""Dtype spelling and the parameter classes that hold quantised storage."""
from __future__ import annotations

import torch

HALF_DTYPES = (torch.float16, torch.bfloat16)
# bitsandbytes (4-bit, 8-bit), optimum-quanto, torchao (AffineQuantizedTensor; quantize_'s Float8Tensor, which
# reports the float dtype it was quantised from): their parameters carry no float dtype to audit
QUANTIZED_PARAM_CLASSES = ("Params4bit", "Int8Params", "QTensor", "AffineQuantizedTensor", "Float8Tensor")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def quantized_or_integer(p: torch.Tensor) -> bool:
    """Quantised storage or a non-float tensor: no precision fix casts it."""
    return type(p).__name__ in QUANTIZED_PARAM_CLASSES or not p.is_floating_point()
