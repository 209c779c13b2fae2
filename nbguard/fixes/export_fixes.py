"""Fixes for an exported artifact that is not the model trained: save what was left out, merge in float32.

Each writes the artifact again (``path=``, the folder the export check read); none changes the trained
model. The cells are plain PEFT/transformers code.
"""
from __future__ import annotations

import os
import tempfile
from typing import Any

from .registry import Fix, Names, Target, register


def _path(path: Any) -> str:
    if not isinstance(path, str) or not path:
        raise ValueError("this fix writes the artifact again: pass path= (the folder you export to)")
    return path


def _path_code(path: Any) -> tuple[str, str]:
    """(the folder as Python code, the import it needs): a folder under the user's home is written
    ``os.path.expanduser('~/…')``, so the cell names the same folder once the home directory is redacted
    to ``~`` (a literal ``'~/…'`` is not expanded by Python: save_pretrained would write into ``./~/``)."""
    home = os.path.expanduser("~").rstrip("/\\")
    if isinstance(path, str) and len(home) > 1 and (path == home or path.startswith((home + "/", home + os.sep))):
        return f"os.path.expanduser({('~' + path[len(home):])!r})", "import os\n"
    return repr(path), ""


# ---- resave-adapter --------------------------------------------------------------------------
def _resave(target: Target, path: str | None = None, **_: Any) -> dict:
    path = _path(path)
    target.model.save_pretrained(path)
    return {"saved": path}


def _resave_code(names: Names, **options: Any) -> str:
    path, needs = _path_code(options.get("path", "adapter_dir"))
    return f"""{needs}# Save the adapter as it is now, after training (a save before training, or from a fresh
# get_peft_model copy, writes lora_B as zeros: an adapter with no effect).
{names.model}.save_pretrained({path})
"""


register(Fix("resave-adapter", "Save the trained adapter again",
             "Write the trained PeftModel's adapter to the export folder (the saved one is not the trained one).",
             _resave, _resave_code))


# ---- save-embedding-layers -------------------------------------------------------------------
def _save_embeddings(target: Target, path: str | None = None, **_: Any) -> dict:
    path = _path(path)
    target.model.save_pretrained(path, save_embedding_layers=True)
    return {"saved": path, "save_embedding_layers": True}


def _save_embeddings_code(names: Names, **options: Any) -> str:
    path, needs = _path_code(options.get("path", "adapter_dir"))
    return f"""{needs}# Save the input and output embeddings with the adapter: rows added by resize_token_embeddings (and
# embeddings trained outside LoRA) are not in the base model, so without them the reload differs.
# Next time, name them in the config instead: LoraConfig(..., modules_to_save=["embed_tokens", "lm_head"]).
{names.model}.save_pretrained({path}, save_embedding_layers=True)
"""


register(Fix("save-embedding-layers", "Save the embeddings with the adapter",
             "save_pretrained(path, save_embedding_layers=True): the resized or trained embedding matrices go into "
             "the adapter file, so base + adapter reloads the embeddings trained.", _save_embeddings,
             _save_embeddings_code))


# ---- save-tokenizer --------------------------------------------------------------------------
def _save_tokenizer(target: Target, path: str | None = None, chat_template: str | None = None, **_: Any) -> dict:
    path = _path(path)
    # the template asked for, else the one training used (TRL's SFTTrainer keeps the template it swapped in)
    template = chat_template or getattr(target.trainer, "chat_template", None)
    if template and getattr(target.tokenizer, "chat_template", None) != template:
        target.tokenizer.chat_template = template
    target.tokenizer.save_pretrained(path)
    return {"saved": path}


def _save_tokenizer_code(names: Names, **options: Any) -> str:
    path, needs = _path_code(options.get("path", "adapter_dir"))
    template = options.get("chat_template")
    if template:
        keep = f"{names.tokenizer}.chat_template = {template!r}\n"
    elif names.trainer:
        keep = ("# the template training used (TRL's training template, if it swapped one in)\n"
                f"{names.tokenizer}.chat_template = getattr({names.trainer}, \"chat_template\", None) or "
                f"{names.tokenizer}.chat_template\n")
    else:
        keep = ""
    return f"""{needs}# Save the tokenizer beside the model: its vocabulary (added tokens) and the chat template training used,
# so whoever loads the folder renders prompts as the model was trained.
{keep}{names.tokenizer}.save_pretrained({path})
"""


register(Fix("save-tokenizer", "Save the tokenizer and chat template beside the model",
             "tokenizer.save_pretrained(path): the vocabulary and the chat template training used go with the artifact.",
             _save_tokenizer, _save_tokenizer_code, needs="tokenizer"))


# ---- merge-in-fp32 ---------------------------------------------------------------------------
def _merge_fp32(target: Target, path: str | None = None, base: str | None = None, dtype: str | None = None,
                **_: Any) -> dict:
    import torch
    from peft import PeftModel

    path = _path(path)
    if not isinstance(base, str) or not base:
        raise ValueError("merge-in-fp32 reloads the base model unquantised: pass base= (its folder or hub id)")
    cast = getattr(torch, str(dtype or "float32"))
    with tempfile.TemporaryDirectory() as adapter_dir:
        target.model.save_pretrained(adapter_dir)
        model = type(target.model.get_base_model()).from_pretrained(base, dtype=torch.float32)
        merged = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
        merged.to(cast).save_pretrained(path)
    return {"saved": path, "merged_in": "float32", "saved_as": str(cast).replace("torch.", "")}


def _merge_fp32_code(names: Names, **options: Any) -> str:
    path = options.get("path", "merged_dir")
    base = options.get("base", "BASE_MODEL")
    dtype = options.get("dtype") or "float32"
    adapter, needs = _path_code(f"{path.rstrip(os.sep)}-adapter")
    path, _ = _path_code(path)
    base, base_needs = _path_code(base)  # a local base folder under $HOME, or a hub id (kept as it is)
    needs = needs or base_needs
    return f"""{needs}import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

# Merge into a float32, unquantised copy of the base: merged into 4-bit or bf16 weights, the adapter's small
# delta is rounded away. Cast after merging, to the dtype you serve in.
{names.model}.save_pretrained({adapter})
_base = AutoModelForCausalLM.from_pretrained({base}, dtype=torch.float32)
_merged = PeftModel.from_pretrained(_base, {adapter}).merge_and_unload()
_merged.to(torch.{dtype}).save_pretrained({path})
"""


register(Fix("merge-in-fp32", "Merge the adapter into a float32 base, then cast",
             "Reload the base unquantised in float32, merge the trained adapter there, cast the merged model to the "
             "dtype you serve in and save it.", _merge_fp32, _merge_fp32_code))
