"""The dtype a checkpoint was saved in, read from its config.json without downloading anything.

``from_pretrained(..., dtype=torch.float16)`` overwrites ``model.config.dtype`` with the dtype it
loaded in, so the config in memory no longer says that the checkpoint was bf16. The file it came
from still does: ``config._name_or_path`` is a local folder or a hub id whose config.json already
sits in the local hub cache (``try_to_load_from_cache`` never touches the network).
"""
from __future__ import annotations

import os
from typing import Any


def _dtype_text(value: Any) -> str | None:
    """'bfloat16' from torch.bfloat16, 'torch.bfloat16' or 'bfloat16'; None for 'auto' or nothing."""
    if value is None:
        return None
    text = str(value).replace("torch.", "")
    return text if text in ("float16", "bfloat16", "float32") else None


def _saved_config_file(name_or_path: str) -> str | None:
    if not name_or_path:
        return None
    local = os.path.join(name_or_path, "config.json")
    if os.path.isfile(local):
        return local
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        cached = try_to_load_from_cache(name_or_path, "config.json")
    except Exception:  # not a valid repo id: nothing cached under it
        return None
    return cached if isinstance(cached, str) and os.path.isfile(cached) else None


def checkpoint_dtype(config: Any) -> tuple[str, str] | None:
    """(dtype, where it was read) for the checkpoint behind ``config``, or None when nothing says.

    The saved config.json wins over the in-memory config, which reflects the load dtype.
    """
    if config is None:
        return None
    path = _saved_config_file(str(getattr(config, "_name_or_path", "") or ""))
    if path is not None:
        from ..introspect.user_files import UserFileError, read_json_object

        try:  # bounded, a FIFO refused, a list where the config's object belongs refused
            saved = read_json_object(path)
        except UserFileError:
            saved = {}
        nested = saved.get("text_config")
        text_config: dict = nested if isinstance(nested, dict) else {}
        for raw in (saved.get("dtype"), saved.get("torch_dtype"), text_config.get("dtype"), text_config.get("torch_dtype")):
            dtype = _dtype_text(raw)
            if dtype is not None:
                return dtype, path
    # transformers 5 names it dtype (reading torch_dtype there only warns it is deprecated); 4.x torch_dtype.
    attr = "dtype" if "dtype" in dir(config) else "torch_dtype"
    dtype = _dtype_text(getattr(config, attr, None))
    return (dtype, f"model.config.{attr}") if dtype is not None else None
