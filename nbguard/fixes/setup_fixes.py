"""Fixes for the data, chat-template and configuration rules: BOS, packing masks, pad ids, MoE routers, train mode."""
from __future__ import annotations

import inspect
from typing import Any

import torch

from ..introspect.modes import applies_dropout, dropout_in_eval
from ..introspect.moe import trainable_router_params
from .registry import Fix, Names, Target, register

PACKING_MARK = "drops_mask_for_packing"  # set on the wrapping collator by apply and by the cell: never wrap twice


# ---- tokenizer-no-bos ------------------------------------------------------------------------
def adds_bos(tok: Any) -> bool:
    """Whether encoding text adds the BOS token: read from what the tokenizer does, not from
    ``add_bos_token`` (a Llama-3-style tokenizer adds it in its post-processor with the flag False)."""
    bos = getattr(tok, "bos_token_id", None)
    return bos is not None and tok("")["input_ids"][:1] == [bos]


def bos_switchable(tok: Any) -> bool:
    """Whether ``add_bos_token = False`` stops this tokenizer adding BOS (tried on a copy)."""
    import copy

    if not adds_bos(tok):
        return False
    trial = copy.deepcopy(tok)
    try:
        trial.add_bos_token = False
    except (AttributeError, ValueError):
        return False
    return not adds_bos(trial)


def _no_bos(target: Target, **_: Any) -> dict:
    tok = target.tokenizer
    if not adds_bos(tok):
        return {}
    before = getattr(tok, "add_bos_token", None)
    tok.add_bos_token = False
    if adds_bos(tok):
        tok.add_bos_token = before
        raise ValueError("fix 'tokenizer-no-bos' cannot stop this tokenizer adding BOS (its post-processor adds it "
                         "whatever add_bos_token says): use 'drop-doubled-bos' on the trainer, or strip the BOS from "
                         "the text before it is tokenized")
    return {"tokenizer.add_bos_token": f"{before} -> False: encoding no longer adds BOS (the chat template writes it)"}


def _no_bos_code(names: Names, **_: Any) -> str:
    t = names.tokenizer
    return f"""# The chat template already writes the BOS token: stop the tokenizer adding a second one, then
# rebuild the dataset / trainer (examples tokenised before this keep their two BOS tokens).
{t}.add_bos_token = False
assert {t}("")["input_ids"][:1] != [{t}.bos_token_id], "this tokenizer still adds BOS: strip it from the text instead"
"""


register(Fix("tokenizer-no-bos", "Stop the tokenizer adding a second BOS",
             "Set tokenizer.add_bos_token = False when the chat template renders BOS itself (rebuild the dataset after).",
             _no_bos, _no_bos_code, needs="tokenizer"))


# ---- drop-doubled-bos ------------------------------------------------------------------------
# The fix's cell carries this function's own source: no annotations, no names from this module.
def drop_first_bos(row, bos):
    """A prepared row that starts with two BOS tokens, without the first: input_ids and every column aligned
    with it (attention_mask, completion_mask, assistant_masks, labels) lose their first element."""
    ids = row["input_ids"]
    if list(ids[:2]) != [bos, bos]:
        return row
    return {k: v[1:] for k, v in row.items() if isinstance(v, list) and len(v) == len(ids)}


def _doubled_rows(dataset: Any, bos: int) -> int:
    return sum(1 for ids in dataset["input_ids"] if list(ids[:2]) == [bos, bos])


def _drop_doubled_bos(target: Target, **_: Any) -> dict:
    trainer, tok = target.trainer, target.tokenizer
    dataset: Any = getattr(trainer, "train_dataset", None)
    if not callable(getattr(dataset, "map", None)) or "input_ids" not in (getattr(dataset, "column_names", None) or []):
        raise ValueError("fix 'drop-doubled-bos' edits the trainer's tokenized rows: its train_dataset must be a "
                         "datasets.Dataset with input_ids (as TRL's SFTTrainer prepares it); otherwise strip the BOS "
                         "from the text before tokenizing")
    bos = tok.bos_token_id
    doubled = _doubled_rows(dataset, bos)
    if not doubled:
        return {}
    trainer.train_dataset = dataset.map(drop_first_bos, fn_kwargs={"bos": bos})
    return {"trainer.train_dataset": f"{doubled} of {len(dataset)} rows start with one BOS instead of two"}


def _drop_doubled_bos_code(names: Names, **_: Any) -> str:
    t = names.trainer
    return f"""# The text already held the BOS its chat template wrote, and tokenizing it added another. The trainer's
# prepared rows lose the first of the two (with every column aligned with input_ids); for new data, strip
# the BOS from the text (text.removeprefix(tokenizer.bos_token)) or pass the messages and let TRL template them.
{inspect.getsource(drop_first_bos)}

{t}.train_dataset = {t}.train_dataset.map(drop_first_bos, fn_kwargs={{"bos": {t}.processing_class.bos_token_id}})
"""


register(Fix("drop-doubled-bos", "Drop the second BOS from the trainer's rows",
             "Remove the first of two leading BOS tokens from the trainer's tokenized rows (TRL's prepared dataset).",
             _drop_doubled_bos, _drop_doubled_bos_code, needs="trainer"))


# ---- drop-mask-for-packing -------------------------------------------------------------------
# The fix's cell carries this class's own source: no annotations, no names from this module.
class DropMaskForPacking:
    """Wraps a collator: packed batches (position_ids present) lose their attention_mask, so transformers
    builds one block per example from position_ids instead of causal attention across the row."""

    drops_mask_for_packing = True

    def __init__(self, collator):
        self.collator = collator

    def __call__(self, features):
        batch = self.collator(features)
        if "position_ids" in batch:
            batch.pop("attention_mask", None)
        return batch


def _drop_mask(target: Target, **_: Any) -> dict:
    trainer = target.trainer
    if getattr(trainer.data_collator, PACKING_MARK, False):
        return {}
    trainer.data_collator = DropMaskForPacking(trainer.data_collator)
    return {"trainer.data_collator": "packed batches no longer carry attention_mask"}


def _drop_mask_code(names: Names, **_: Any) -> str:
    t = names.trainer
    return f"""# Packed rows: transformers separates the examples by position_ids only when attention_mask is absent.
{inspect.getsource(DropMaskForPacking)}

if not getattr({t}.data_collator, "{PACKING_MARK}", False):
    {t}.data_collator = DropMaskForPacking({t}.data_collator)
"""


register(Fix("drop-mask-for-packing", "Drop attention_mask from packed batches",
             "Wrap the collator so packed batches carry position_ids only: each example attends to itself alone.",
             _drop_mask, _drop_mask_code, needs="trainer"))


# ---- sync-pad-token-id -----------------------------------------------------------------------
def _sync_pad(target: Target, **_: Any) -> dict:
    tok, model = target.tokenizer, target.model
    if model is None:
        raise ValueError("fix 'sync-pad-token-id' sets model.config.pad_token_id: pass model= (or trainer=)")
    if tok.pad_token_id is None:
        raise ValueError("the tokenizer has no pad token: apply 'distinct-pad-token' first")
    return set_pad_token_id(model, tok.pad_token_id)


# The fix's cell carries this function's own source: apply sets the ids with it too.
def set_pad_token_id(model, pad_id):
    """The pad id on the config the head reads (the language model's: get_text_config()) and on the model's own
    config where it has one (a multimodal config may have none). Returns what changed."""
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    changed = {}
    for owner in {id(c): c for c in (config, text)}.values():
        old = getattr(owner, "pad_token_id", None)
        if (owner is text or hasattr(owner, "pad_token_id")) and old != pad_id:
            owner.pad_token_id = pad_id
            changed[f"{type(owner).__name__}.pad_token_id"] = f"{old} -> {pad_id}"
    return changed


def _sync_pad_code(names: Names, **_: Any) -> str:
    m, t = names.model, names.tokenizer
    return f"""# The classification head pools the last token that is not config.pad_token_id: use the tokenizer's pad id.
{inspect.getsource(set_pad_token_id)}

set_pad_token_id({m}, {t}.pad_token_id)
"""


register(Fix("sync-pad-token-id", "Give the model the tokenizer's pad id",
             "Set model.config.pad_token_id to tokenizer.pad_token_id so a classification head pools each row's last token.",
             _sync_pad, _sync_pad_code, needs="tokenizer"))


# ---- enable-router-aux-loss / freeze-moe-router ----------------------------------------------
def _moe_configs(model: Any) -> list[Any]:
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return list({id(c): c for c in (config, text)}.values())


def _router_aux(target: Target, **_: Any) -> dict:
    changed = {}
    for config in _moe_configs(target.model):
        if not getattr(config, "output_router_logits", False):
            config.output_router_logits = True
            changed[f"{type(config).__name__}.output_router_logits"] = "False -> True"
    return changed


def _router_aux_code(names: Names, **_: Any) -> str:
    m = names.model
    return f"""# Add router_aux_loss_coef x the load-balancing loss to the loss, so trained routers keep using every expert.
{m}.config.output_router_logits = True
{m}.config.get_text_config().output_router_logits = True
"""


register(Fix("enable-router-aux-loss", "Train MoE routers with the load-balancing loss",
             "Set config.output_router_logits = True so the forward adds router_aux_loss_coef x the auxiliary loss.",
             _router_aux, _router_aux_code))


def _freeze_router(target: Target, **_: Any) -> dict:
    params = trainable_router_params(target.model)
    for _name, param in params:
        param.requires_grad_(False)
    return {"frozen": [name for name, _ in params]} if params else {}


def _freeze_router_code(names: Names, **_: Any) -> str:
    return f"""# Keep the MoE routers as pre-trained (rebuild the optimizer / trainer after this).
for name, module in {names.model}.named_modules():
    if "Router" in type(module).__name__ or "TopK" in type(module).__name__:
        module.requires_grad_(False)
"""


register(Fix("freeze-moe-router", "Freeze the MoE routers",
             "requires_grad=False on the router weights so fine-tuning cannot collapse expert routing.",
             _freeze_router, _freeze_router_code))


# ---- dropout-train-mode ----------------------------------------------------------------------
def _dropout_train(target: Target, **_: Any) -> dict:
    off = dropout_in_eval(target.model)
    modules = dict(target.model.named_modules())
    for name in off:
        modules[name].train(True)  # dropout layers only: modules the user keeps in eval on purpose stay there
    return {"dropout_back_in_train_mode": off} if off else {}


def _dropout_train_code(names: Names, **_: Any) -> str:
    return f"""import torch


{inspect.getsource(applies_dropout)}

# A wrapper's train() did not reach these dropout layers after evaluation: put them back in training mode.
if {names.model}.training:
    for module in {names.model}.modules():
        if not module.training and applies_dropout(module):
            module.train(True)
"""


register(Fix("dropout-train-mode", "Put dropout layers back in training mode",
             "Dropout layers (p > 0) left in eval mode inside a training model go back to train mode.",
             _dropout_train, _dropout_train_code))


# ---- model-train-mode ------------------------------------------------------------------------
def _model_train(target: Target, **_: Any) -> dict:
    model = target.model
    off = [name or "(the model)" for name, module in model.named_modules() if not module.training]
    if model.training or not off:
        return {}
    model.train()
    return {"back_in_train_mode": off[:10], "modules": len(off)}


def _model_train_code(names: Names, **_: Any) -> str:
    return f"""# model.eval() for a validation pass left dropout off (and batch-norm statistics frozen) for training:
# put the model back in training mode, and in the loop call {names.model}.train() after every evaluation.
{names.model}.train()
"""


register(Fix("model-train-mode", "Put the model back in training mode after evaluation",
             "model.train() on a model left in eval mode by an evaluation pass (or by from_pretrained), so "
             "dropout and batch-norm train as configured.",
             _model_train, _model_train_code))


# ---- disable-cudnn-sdp -----------------------------------------------------------------------
def _no_cudnn_sdp(target: Target, **_: Any) -> dict:
    if not torch.backends.cuda.cudnn_sdp_enabled():
        return {}
    torch.backends.cuda.enable_cudnn_sdp(False)
    return {"torch.backends.cuda.cudnn_sdp": "enabled -> disabled"}


def _no_cudnn_sdp_code(names: Names, **_: Any) -> str:
    return """import torch

# The cuDNN SDPA backward returns NaN on Hopper with a padding mask on some torch releases: use flash / mem-efficient.
torch.backends.cuda.enable_cudnn_sdp(False)
"""


register(Fix("disable-cudnn-sdp", "Turn off the cuDNN attention backend",
             "torch.backends.cuda.enable_cudnn_sdp(False): SDPA falls back to the flash or memory-efficient kernel.",
             _no_cudnn_sdp, _no_cudnn_sdp_code, needs="model-or-args"))


# ---- non-reentrant-checkpointing -------------------------------------------------------------
# The fix's cell carries this function's own source: apply asks it too.
def checkpoints_reentrant(model):
    """Whether a checkpointed layer of the model runs torch's checkpoint without use_reentrant=False."""
    return any(getattr(getattr(m, "_gradient_checkpointing_func", None), "keywords", {}).get("use_reentrant") is not False
               for m in model.modules() if getattr(m, "gradient_checkpointing", False))


def _non_reentrant(target: Target, **_: Any) -> dict:
    changed: dict[str, Any] = {}
    args, model = target.args, target.model
    if args is not None and getattr(args, "gradient_checkpointing", False):
        kwargs = dict(getattr(args, "gradient_checkpointing_kwargs", None) or {})
        if kwargs.get("use_reentrant") is not False:
            args.gradient_checkpointing_kwargs = {**kwargs, "use_reentrant": False}
            changed["args.gradient_checkpointing_kwargs"] = "use_reentrant=False"
    if model is not None and getattr(model, "is_gradient_checkpointing", False) and checkpoints_reentrant(model):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        changed["model"] = "checkpointing re-enabled with use_reentrant=False"
    return changed


def _non_reentrant_code(names: Names, **_: Any) -> str:
    lines = ["# Non-reentrant checkpointing: DDP sees the checkpointed parameters once (no \"marked ready twice\")."]
    if names.args is not None:  # (arguments without checkpointing stay as they are)
        lines += [f"if {names.args}.gradient_checkpointing:",
                  f"    {names.args}.gradient_checkpointing_kwargs = {{"
                  f"**({names.args}.gradient_checkpointing_kwargs or {{}}), \"use_reentrant\": False}}"]
    lines += ["", inspect.getsource(checkpoints_reentrant),
              f"if getattr({names.model}, \"is_gradient_checkpointing\", False) and checkpoints_reentrant({names.model}):",
              f"    {names.model}.gradient_checkpointing_enable(gradient_checkpointing_kwargs={{\"use_reentrant\": False}})"]
    return "\n".join(lines) + "\n"


register(Fix("non-reentrant-checkpointing", "Checkpoint without reentrancy",
             "gradient_checkpointing_kwargs={'use_reentrant': False} on the arguments and the model.",
             _non_reentrant, _non_reentrant_code, needs="model-or-args"))


# ---- mask-special-labels ---------------------------------------------------------------------
# The fix's cell carries this class's own source: no annotations, no names from this module.
class MaskSpecialLabels:
    """Wraps a collator: labels equal to the image token id, and negative labels, become -100."""

    masks_special_labels = True

    def __init__(self, collator, image_token_id):
        self.collator, self.image_token_id = collator, image_token_id

    def __call__(self, features):
        batch = self.collator(features)
        labels = batch["labels"]
        bad = labels < 0
        if self.image_token_id is not None:
            bad |= labels == self.image_token_id
        batch["labels"] = labels.masked_fill(bad, -100)
        return batch


# The fix's cell carries this function's own source: apply reads the id with it too.
def image_token_id(model):
    """The model's image placeholder id: config.image_token_id, or image_token_index (older configs); else None."""
    config = getattr(model, "config", None)
    for name in ("image_token_id", "image_token_index"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


def _mask_labels(target: Target, **_: Any) -> dict:
    trainer = target.trainer
    if getattr(trainer.data_collator, "masks_special_labels", False):
        return {}
    token = image_token_id(trainer.model)
    trainer.data_collator = MaskSpecialLabels(trainer.data_collator, token)
    return {"trainer.data_collator": f"labels equal to {token} or negative become -100"}


def _mask_labels_code(names: Names, **_: Any) -> str:
    t = names.trainer
    return f"""# Never supervise image placeholders, and give cross-entropy only -100 as the ignored label.
{inspect.getsource(MaskSpecialLabels)}

{inspect.getsource(image_token_id)}

if not getattr({t}.data_collator, "masks_special_labels", False):
    {t}.data_collator = MaskSpecialLabels({t}.data_collator, image_token_id({t}.model))
"""


register(Fix("mask-special-labels", "Mask image-token and negative labels",
             "Wrap the collator so labels equal to the image token id, or negative, become -100.",
             _mask_labels, _mask_labels_code, needs="trainer"))
