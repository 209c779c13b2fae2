"""A plain loop's optimizer and GradScaler, as the audit takes them: a clear error for anything else."""
from __future__ import annotations

from typing import Any

from ..introspect.optimizers import is_optimizer


def check_loop_objects(optimizer: Any, scaler: Any) -> None:
    if optimizer is not None and not is_optimizer(optimizer):
        raise TypeError(f"optimizer= must be a torch optimizer (torch.optim.AdamW(model.parameters(), ...)); "
                        f"got {type(optimizer).__name__}")
    if scaler is not None and not (callable(getattr(scaler, "scale", None)) and callable(getattr(scaler, "unscale_", None))):
        raise TypeError(f"scaler= must be a torch.amp.GradScaler; got {type(scaler).__name__}")
