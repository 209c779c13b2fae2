"""The export check: is the artifact you ship the model you trained?

Fixed probe batches (the trainer's own when it has data, else synthetic token rows) go through three
models: the trained model, the same model with its adapter disabled (``with model.disable_adapter():``),
and the exported artifact loaded back the way users load it (the base named in adapter_config.json
plus the adapter, as ``AutoPeftModelForCausalLM.from_pretrained`` does it, or the merged model in the
dtype it was saved in). The logits say *whether* they differ (max |difference|, top-1 agreement); the
saved files and the parameters say *what* differs. :class:`ExportFacts` holds both; the rules in
``rules/export.py`` turn them into findings.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from ..introspect.inputs import is_trainer
from ..introspect.modes import in_eval_mode
from ..introspect.tokenizers import tokenizer_of
from ..introspect.user_files import UserFileError, field_of, read_json_object, safetensors_header, special_kind
from .saved_tensors import hollow_tensors

PROBE_ROWS = 4
PROBE_LEN = 24
# A difference is "none" below this share of the logits' own scale (float32 noise across two loads).
SAME = 1e-4
# The adapter's effect is lost when what the artifact changes is at least this share of the adapter's effect.
LOST_SHARE = 0.1
ADAPTER_FILES = ("adapter_model.safetensors", "adapter_model.bin")
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model", "vocab.json")


@dataclass
class Comparison:
    """Logits of two models over the same probe tokens."""

    name: str  # "trained vs adapter disabled", ...
    max_logit_diff: float
    logit_scale: float  # max |logit| of the reference: what the difference is measured against
    top1_agreement: float
    vocab: tuple[int, int]
    positions: int

    @property
    def same(self) -> bool:
        return self.vocab[0] == self.vocab[1] and self.max_logit_diff <= SAME * max(1.0, self.logit_scale)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "max_logit_diff": self.max_logit_diff, "logit_scale": self.logit_scale,
                "top1_agreement": self.top1_agreement, "vocab": list(self.vocab), "positions": self.positions}

    def line(self) -> str:
        vocab = "" if self.vocab[0] == self.vocab[1] else f", vocab {self.vocab[0]} vs {self.vocab[1]}"
        return (f"{self.name}: max |logit difference| {self.max_logit_diff:.4g} (logits up to {self.logit_scale:.3g}), "
                f"top-1 agreement {100 * self.top1_agreement:.1f}% of {self.positions} positions{vocab}")


@dataclass
class ExportFacts:
    """What the export check measured and read; the export rules judge it."""

    kind: str  # "adapter" (a folder with adapter_config.json), "merged" (a full model folder) or "model" (an object)
    path: str | None
    trained_is_peft: bool
    comparisons: dict[str, Comparison] = field(default_factory=dict)  # "effect", "artifact", "artifact_effect"
    lora: dict[str, Any] = field(default_factory=dict)  # the trained adapter: layers, zero lora_B, scalings
    saved: dict[str, Any] = field(default_factory=dict)  # the saved adapter file: lora_B tensors, zero ones, keys
    differing: dict[str, dict] = field(default_factory=dict)  # parameter -> how trained and reloaded differ
    ties: dict[str, bool | None] = field(default_factory=dict)  # "trained" / "reloaded": input and output tied
    artifact_dtype: str | None = None
    trained_dtype: str | None = None
    base_quantized: bool = False
    base_vocab: int | None = None  # the vocab size of the base checkpoint the adapter names
    tokenizer: dict[str, Any] = field(default_factory=dict)
    probe_source: str = "synthetic"
    load: dict[str, Any] = field(default_factory=dict)  # how the artifact was loaded back
    embedding_params: list[str] = field(default_factory=list)  # the trained model's input/output embedding weights
    merge: dict[str, Any] = field(default_factory=dict)  # merge_fidelity(): the update the merged weights carry

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "path": self.path, "trained_is_peft": self.trained_is_peft,
                "comparisons": {k: c.to_dict() for k, c in self.comparisons.items()}, "lora": self.lora,
                "saved": self.saved, "differing": self.differing, "ties": self.ties,
                "artifact_dtype": self.artifact_dtype, "trained_dtype": self.trained_dtype,
                "base_quantized": self.base_quantized, "base_vocab": self.base_vocab, "tokenizer": self.tokenizer,
                "probe_source": self.probe_source, "load": self.load,
                "embedding_params": self.embedding_params, "merge": self.merge}


# ---- inputs ------------------------------------------------------------------------------------
def is_peft_model(model: Any) -> bool:
    return any(c.__module__.startswith("peft.") for c in type(model).__mro__) and hasattr(model, "peft_config")


def lora_layers(model: torch.nn.Module) -> list[tuple[str, Any]]:
    """The LoRA layers (PEFT tuner layers with lora_A/lora_B) of a PEFT model."""
    return [(n, m) for n, m in model.named_modules() if hasattr(m, "lora_A") and hasattr(m, "lora_B")
            and any(c.__module__.startswith("peft.") for c in type(m).__mro__)]


def resolve_inputs(model: Any, exported: Any, trainer: Any) -> tuple[Any, Any, str, str | None]:
    """(trained model, trainer, artifact kind, path), with a clear error for what cannot be checked."""
    if is_trainer(model):
        trainer, model = model, model.model
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"check_export needs the trained model (a PeftModel or a transformers model) or a Trainer "
                        f"as its first argument; got {type(model).__name__}")
    if is_peft_model(model) and not lora_layers(model) and not _other_tuner_layers(model):
        raise ValueError("the model has no adapter layers left: merge_and_unload() (or unload()) merged the adapter "
                         "into it in place, so there is no trained adapter to compare with. Run check_export before "
                         "merging, or check a merged copy: merged = copy.deepcopy(model).merge_and_unload()")
    if isinstance(exported, torch.nn.Module):
        if exported is model or (is_peft_model(model) and exported is model.get_base_model()):  # type: ignore[operator]
            raise ValueError("exported is the trained model itself (merge_and_unload() merges in place and returns "
                             "the same modules): pass the folder you saved, or a merged copy: "
                             "merged = copy.deepcopy(model).merge_and_unload()")
        return model, trainer, "model", None
    if not isinstance(exported, (str, os.PathLike)):
        raise TypeError(f"exported must be a folder written by save_pretrained (an adapter or a full model) or a model "
                        f"object (e.g. merge_and_unload()'s result); got {type(exported).__name__}")
    path = os.fspath(exported)
    if not os.path.isdir(path):
        raise ValueError(f"exported folder {path!r} does not exist: pass the folder you gave save_pretrained")
    files = set(os.listdir(path))
    if "adapter_config.json" in files:
        if not is_peft_model(model):
            raise ValueError(f"{path!r} holds a PEFT adapter, but the model given is not a PeftModel: pass the "
                             "PeftModel you trained (trainer.model)")
        return model, trainer, "adapter", path
    if "config.json" in files:
        return model, trainer, "merged", path
    shown = ", ".join(sorted(files)[:8]) or "nothing"
    raise ValueError(f"{path!r} is neither an adapter folder (adapter_config.json) nor a model folder (config.json); "
                     f"it holds {shown}. Pass the folder save_pretrained wrote")


def _other_tuner_layers(model: torch.nn.Module) -> bool:
    return any(any(c.__name__ == "BaseTunerLayer" for c in type(m).__mro__) for _, m in model.named_modules())


def model_device(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def vocab_size(model: torch.nn.Module) -> int | None:
    getter = getattr(model, "get_input_embeddings", None)
    try:
        emb = getter() if callable(getter) else None
    except (NotImplementedError, AttributeError):
        emb = None
    weight = getattr(emb, "weight", None)
    return int(weight.shape[0]) if weight is not None else None


def probe_batches(trainer: Any, batch: Any, vocab: int) -> tuple[list[dict[str, torch.Tensor]], str]:
    """The batch given, else a few of the trainer's own batches, else synthetic rows of token ids."""
    if batch is not None:
        return [{k: v for k, v in dict(batch).items() if isinstance(v, torch.Tensor)}], "batch"
    if trainer is not None:
        from .sampling import sample_trainer_batches

        try:
            sample = sample_trainer_batches(trainer, count=2)
        except Exception:  # the synthetic rows still compare the models
            sample = None
        if sample is not None and sample.batches:
            return sample.batches, "trainer"
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (PROBE_ROWS, PROBE_LEN), generator=gen)
    return [{"input_ids": ids, "attention_mask": torch.ones_like(ids)}], "synthetic"


def logits_of(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]], vocab: int) -> list[torch.Tensor]:
    """float32 logits on the CPU, in eval mode (no dropout), every module's train/eval mode put back."""
    device = model_device(model)
    out = []
    with in_eval_mode(model), torch.no_grad():
        for b in batches:
            ids = b["input_ids"].clamp(max=vocab - 1).to(device)
            mask = b.get("attention_mask")
            kwargs = {"attention_mask": mask.to(device)} if mask is not None else {}
            out.append(model(input_ids=ids, **kwargs).logits.float().cpu())
    return out


def compare(name: str, ref: list[torch.Tensor], other: list[torch.Tensor], batches: list[dict]) -> Comparison:
    diff, scale, agree, total = 0.0, 0.0, 0, 0
    for a, b, batch in zip(ref, other, batches):
        mask = batch.get("attention_mask")
        keep = mask.bool() if mask is not None else torch.ones(a.shape[:2], dtype=torch.bool)
        n = min(a.shape[-1], b.shape[-1])
        da, db = a[keep], b[keep]
        if da.numel() == 0:
            continue
        diff = max(diff, float((da[:, :n] - db[:, :n]).abs().max()))
        scale = max(scale, float(da.abs().max()))
        agree += int((da.argmax(-1) == db.argmax(-1)).sum())
        total += int(keep.sum())
    return Comparison(name, diff, scale, agree / total if total else 1.0, (ref[0].shape[-1], other[0].shape[-1]), total)


# ---- what the files and parameters say ---------------------------------------------------------
def read_lora(model: torch.nn.Module) -> dict[str, Any]:
    layers = lora_layers(model)
    zero_b, scalings, active = [], {}, getattr(model, "active_adapter", "default")
    for name, layer in layers:
        for b in getattr(layer, "lora_B", {}).values():
            weight = getattr(b, "weight", None)
            if weight is not None and not bool(weight.detach().ne(0).any()):
                zero_b.append(name)
        scaling = getattr(layer, "scaling", {})
        if isinstance(scaling, dict) and active in scaling:
            scalings[name] = float(scaling[active])
    configs = getattr(model, "peft_config", {}) or {}
    cfg = configs.get(active) if isinstance(active, str) else None
    targets = getattr(cfg, "target_modules", None)
    return {"layers": len(layers), "zero_lora_B": zero_b[:10], "zero_lora_B_count": len(zero_b),
            "zero_scaling": [n for n, s in scalings.items() if s == 0][:10],
            "target_modules": sorted(targets) if isinstance(targets, (set, list, tuple)) else targets,
            "lora_alpha": getattr(cfg, "lora_alpha", None), "r": getattr(cfg, "r", None),
            "modules_to_save": sorted(getattr(cfg, "modules_to_save", None) or [])}


def read_saved_adapter(path: str) -> dict[str, Any]:
    """The tensors of the saved adapter file: how many lora_B there are, and which are all zeros. A file that
    cannot be read (a special file, a header out of bounds, a pickle weights_only refuses) gives ``error``."""
    file = next((os.path.join(path, f) for f in ADAPTER_FILES if os.path.lexists(os.path.join(path, f))), None)
    if file is None:
        return {"file": None}
    try:
        state = _load_adapter_tensors(file)
    except Exception as exc:  # whatever the file holds, what it does is a finding, not a crash
        reason = exc.reason if isinstance(exc, UserFileError) else f"{type(exc).__name__}: {str(exc)[:300]}"
        return {"file": os.path.basename(file), "error": f"{os.path.basename(file)}: {reason}"}
    b_keys = [k for k in state if ".lora_B." in k or k.endswith("lora_B.weight")]
    zero = [k for k in b_keys if not bool(state[k].ne(0).any())]
    return {"file": os.path.basename(file), "keys": len(state), "lora_B": len(b_keys), "zero_lora_B": zero[:10],
            "zero_lora_B_count": len(zero), "embedding_keys": sorted(k for k in state if "embed" in k or "lm_head" in k)[:10],
            "other_keys": sorted(k for k in state if "lora_" not in k)[:20], **hollow_tensors(state)}


def _load_adapter_tensors(file: str) -> dict[str, torch.Tensor]:
    kind = special_kind(file)
    if kind is not None:
        raise UserFileError(file, f"is {kind}, not a regular file: nbguard does not read it")
    if file.endswith(".safetensors"):
        from safetensors.torch import load_file

        safetensors_header(file)  # the header's length and every tensor's bytes bounded by the file, first
        return load_file(file)
    state = torch.load(file, map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise UserFileError(file, f"holds {type(state).__name__} where a state dict of tensors belongs")
    return state


def _special_files(path: str) -> list[str]:
    """The folder's entries that are FIFOs, devices or sockets: PEFT and transformers open files by name, and a
    FIFO under a name they read would hang the check."""
    try:
        names = sorted(os.listdir(path))
    except OSError:
        return []
    return [f"{n} is {kind}" for n in names[:10000] if (kind := special_kind(os.path.join(path, n))) is not None
            and kind != "a directory"]


def _strip(name: str) -> str:
    return name.replace(".modules_to_save.default", "").replace(".original_module", "")


def differing_parameters(trained: torch.nn.Module, reloaded: torch.nn.Module) -> dict[str, dict]:
    """Parameters (by name) whose shape or values differ between the trained model and the reloaded one."""
    theirs = dict(reloaded.named_parameters())
    out: dict[str, dict] = {}
    for name, p in trained.named_parameters():
        q = theirs.get(name)
        if q is None:
            out[name] = {"missing": True, "trainable": p.requires_grad}
            continue
        if tuple(p.shape) != tuple(q.shape):
            out[name] = {"shape": [list(p.shape), list(q.shape)], "trainable": p.requires_grad}
            continue
        if not p.is_floating_point() or not q.is_floating_point():
            continue
        a, b = p.detach().float().cpu(), q.detach().float().cpu()
        delta = (a - b).abs()
        tol = 1e-2 * float(a.abs().max()) if b.dtype != a.dtype or q.dtype != p.dtype else 0.0
        tol = max(tol, _rounding(q.dtype) * float(a.abs().max()))
        if float(delta.max()) > tol:
            rows = delta.reshape(delta.shape[0], -1).amax(dim=1) > tol if delta.dim() >= 1 else delta
            out[name] = {"max_diff": float(delta.max()), "trainable": p.requires_grad,
                         "rows": [int(i) for i in torch.nonzero(rows).flatten()[:10]] if delta.dim() >= 2 else None,
                         "row_count": int(rows.sum()) if delta.dim() >= 2 else None, "rows_total": int(delta.shape[0])}
    return out


def _rounding(dtype: torch.dtype) -> float:
    return {torch.float16: 1e-3, torch.bfloat16: 8e-3}.get(dtype, 1e-6)


def tied(model: Any) -> bool | None:
    try:
        inp, out = model.get_input_embeddings(), model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        return None
    if inp is None or out is None:
        return None
    a, b = getattr(inp, "weight", None), getattr(out, "weight", None)
    if a is None or b is None:
        return None
    return a is b or (a.data_ptr() == b.data_ptr() and a.shape == b.shape)


def embedding_names(model: torch.nn.Module) -> list[str]:
    """The parameter names of the input and output embedding weights (through PEFT wrappers)."""
    wanted = []
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        fn = getattr(model, getter, None)
        try:
            module = fn() if callable(fn) else None
        except (AttributeError, NotImplementedError):
            module = None
        weight = getattr(module, "weight", None)
        if weight is not None:
            wanted.append(weight)
    names = [n for n, p in model.named_parameters() if any(p is w for w in wanted)]
    # a modules_to_save or LoRA-wrapped embedding: its base layer and copies count too
    names += [n for n, _ in model.named_parameters() if n not in names
              and any(part in n.split(".") for part in ("embed_tokens", "lm_head", "wte", "embed_out"))
              and "lora_" not in n]
    return names


def dtype_of(model: torch.nn.Module) -> str | None:
    counts: dict[torch.dtype, int] = {}
    for p in model.parameters():
        if p.is_floating_point():
            counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    return str(max(counts, key=counts.__getitem__)).replace("torch.", "") if counts else None


def quantized(model: torch.nn.Module) -> bool:
    from ..introspect.dtypes import QUANTIZED_PARAM_CLASSES

    return any(type(p).__name__ in QUANTIZED_PARAM_CLASSES for p in model.parameters())


def merge_fidelity(trained: Any, merged: torch.nn.Module) -> dict[str, Any]:
    """How much of the adapter's weight update the merged weights carry, layer by layer, in float32:
    ``||W_merged - (W_base + delta)|| / ||delta||`` over every LoRA layer (``lost_share``). Judged on the
    weights, not the logits: a merge kept in float32 of a model trained on a bf16 base computes in another
    precision than the model trained did, and its logits differ by that alone. Empty where the base is
    quantised (the trained model's base is then its dequantised 4-bit weights, a question for the logits)."""
    if quantized(trained):
        return {}
    modules = dict(merged.named_modules())
    active = getattr(trained, "active_adapter", "default")
    lost2 = delta2 = 0.0
    worst: list[tuple[float, str]] = []
    skipped: list[str] = []
    shared: list[torch.Tensor] = []  # the merged weights seen so far
    shared_merged: list[str] = []  # layers whose weight another layer's adapter was merged into (tied weights)
    adapted: dict[int, str] = {}  # data_ptr of each adapted layer's base weight -> the layer
    with torch.no_grad():
        for name, layer in lora_layers(trained):
            target = modules.get(name.removeprefix("base_model.model."))
            merged_weight = getattr(target, "weight", None)
            base_weight = getattr(getattr(layer, "base_layer", None), "weight", None)
            try:
                delta = layer.get_delta_weight(active).float()
            except Exception:  # another tuner's layer, or an adapter this PEFT cannot merge: not judged here
                delta = None
            if merged_weight is None or base_weight is None or delta is None \
                    or len({tuple(merged_weight.shape), tuple(base_weight.shape), tuple(delta.shape)}) != 1:
                skipped.append(name)
                continue
            lost = float((merged_weight.float() - (base_weight.float() + delta)).norm())
            size = float(delta.norm())
            lost2, delta2 = lost2 + lost ** 2, delta2 + size ** 2
            if any(merged_weight is w for w in shared):
                shared_merged.append(name)  # one weight for two layers: both adapters' updates land in it
            shared.append(merged_weight)
            adapted[base_weight.data_ptr()] = name
            worst.append((lost / size if size else (math.inf if lost else 0.0), name))
        # a layer without an adapter whose weight is tied to an adapted one (the input embeddings of a tied
        # lm_head): the model trained used it as it was; a merge writes the adapter's update into it
        for name, module in trained.named_modules():
            weight = getattr(module, "weight", None)
            if not isinstance(weight, torch.Tensor) or weight.data_ptr() not in adapted or name in adapted.values() \
                    or any(name.startswith(f"{a}.") for a in adapted.values()):
                continue
            merged_weight = getattr(modules.get(name.removeprefix("base_model.model.")), "weight", None)
            if merged_weight is None or merged_weight.shape != weight.shape:
                continue
            lost = float((merged_weight.float() - weight.float()).norm())
            if lost:
                lost2 += lost ** 2
                shared_merged.append(name)
                worst.append((math.inf, name))
    if not worst:
        return {"layers": 0, "skipped": skipped[:10]}
    worst.sort(reverse=True)
    # per layer: the share of its own update lost (None: no update of its own, changed by another's merge)
    return {"lost_share": (lost2 ** 0.5) / (delta2 ** 0.5) if delta2 else 0.0, "layers": len(worst),
            "worst": {n: share if math.isfinite(share) else None for share, n in worst[:3]},
            "skipped": skipped[:10], "shared_weight": shared_merged}


# ---- loading the artifact back ------------------------------------------------------------------
def _base_path(path: str, base: Any) -> str:
    file = os.path.join(path, "adapter_config.json")
    cfg = read_json_object(file)  # checked even with base= given: PEFT reads it to load the adapter
    if base is not None:
        return os.fspath(base)
    name = field_of(cfg, "base_model_name_or_path", str, file)
    if not name:
        raise ValueError(f"{path}/adapter_config.json names no base_model_name_or_path (the base was built from a "
                         "config): pass base= the folder where you saved the base model")
    if os.path.isdir(name):
        return name
    try:
        from huggingface_hub import try_to_load_from_cache
        cached = try_to_load_from_cache(name, "config.json")
    except Exception:  # not a repo id
        cached = None
    if isinstance(cached, str):
        return name
    raise ValueError(f"the adapter's base model {name!r} is neither a local folder nor in the Hugging Face cache, and "
                     "nbguard downloads nothing: pass base= the local folder of the base model")


def _load_kwargs(trained: torch.nn.Module) -> dict[str, Any]:
    cfg = getattr(trained, "config", None)
    q = getattr(cfg, "quantization_config", None)
    return {"quantization_config": q} if q is not None and quantized(trained) else {}


def load_adapter(trained: Any, path: str, base: Any) -> tuple[Any, dict]:
    """base + adapter as AutoPeftModelForCausalLM.from_pretrained does it (the saved tokenizer's vocab
    resizes the base first), in the base checkpoint's own dtype and the trained model's quantisation."""
    from peft import PeftModel
    from transformers import AutoTokenizer

    base_path = _base_path(path, base)
    cls = type(trained.get_base_model())
    kwargs = _load_kwargs(trained)
    model = cls.from_pretrained(base_path, dtype="auto", **kwargs)
    info: dict[str, Any] = {"base": base_path, "class": cls.__name__, "dtype": "auto (the saved dtype)",
                            "quantized": bool(kwargs)}
    info["base_vocab"] = vocab_size(model)
    if os.path.isfile(os.path.join(path, "tokenizer_config.json")):
        tok = AutoTokenizer.from_pretrained(path)
        if info["base_vocab"] is not None and len(tok) > info["base_vocab"]:
            model.resize_token_embeddings(len(tok))
            info["resized_to"] = len(tok)
    peft_model = PeftModel.from_pretrained(model, path)
    return peft_model.to(model_device(trained)), info


def load_merged(trained: Any, path: str) -> tuple[Any, dict]:
    cls: Any = type(trained.get_base_model()) if is_peft_model(trained) else type(trained)
    model = cls.from_pretrained(path, dtype="auto")
    return model.to(model_device(trained)), {"class": cls.__name__, "dtype": "auto (the saved dtype)"}


# ---- the tokenizer beside the artifact ---------------------------------------------------------
def read_tokenizer(path: str | None, tokenizer: Any, training_template: str | None) -> dict[str, Any]:
    if path is None or tokenizer is None:
        return {}
    files = sorted(f for f in os.listdir(path) if f in TOKENIZER_FILES)
    out: dict[str, Any] = {"files": files, "training_template": training_template is not None,
                           "training_vocab": len(tokenizer)}
    if not files:
        return out
    from transformers import AutoTokenizer

    try:
        saved = AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # a broken save is a finding, not a crash
        out["error"] = f"{type(exc).__name__}: {exc}"
        return out
    template = getattr(saved, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    out["saved_vocab"] = len(saved)
    out["saved_template"] = template is not None
    if training_template is not None and template is not None and template != training_template:
        from .chat_render import first_difference

        out["template_difference"] = first_difference(tokenizer, training_template, saved, template)
    return out


def training_template(trainer: Any, tokenizer: Any) -> str | None:
    template = getattr(trainer, "chat_template", None) or getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    return template if isinstance(template, str) else None


# ---- the whole check ---------------------------------------------------------------------------
def measure(model: Any, exported: Any, *, trainer: Any = None, tokenizer: Any = None, batch: Any = None,
            base: Any = None) -> tuple[Any, Any, ExportFacts]:
    """(trained model, trainer, facts): run the probes, load the artifact back, read the files."""
    model, trainer, kind, path = resolve_inputs(model, exported, trainer)
    if tokenizer is None and trainer is not None:
        tokenizer = tokenizer_of(trainer)
    peft = is_peft_model(model)
    facts = ExportFacts(kind=kind, path=path, trained_is_peft=peft, trained_dtype=dtype_of(model),
                        base_quantized=quantized(model))
    if kind == "adapter":
        facts.saved = read_saved_adapter(path)  # type: ignore[arg-type]
    artifact: Any = None
    special = _special_files(path) if path is not None else []
    try:
        if special:  # what the libraries would open and wait on: not handed to them
            raise UserFileError(path or "", "holds files that are not regular files (" + "; ".join(special[:5])
                                + "): loading the folder would wait on them for ever")
        if kind == "adapter":
            artifact, facts.load = load_adapter(model, path, base)  # type: ignore[arg-type]
            facts.base_vocab = facts.load.get("base_vocab")
        elif kind == "merged":
            artifact, facts.load = load_merged(model, path)  # type: ignore[arg-type]
        else:
            artifact = exported
    except UserFileError as exc:  # a file of the folder is not what it should be: the reload fails on it too
        facts.load = {"error": str(exc)}
    except ValueError as exc:
        if "nbguard downloads nothing" in str(exc) or "pass base=" in str(exc):
            raise  # the caller's to fix: which base to load
        facts.load = {"error": f"{type(exc).__name__}: {exc}"}
    except Exception as exc:  # the user's reload fails the same way (a refused pickle, a corrupt file): a finding
        facts.load = {"error": f"{type(exc).__name__}: {str(exc)[:2000]}"}
    if special:
        return model, trainer, facts  # nothing more is read from a folder like this one
    facts.tokenizer = read_tokenizer(path, tokenizer, training_template(trainer, tokenizer))
    if "error" in facts.load:
        return model, trainer, facts
    facts.artifact_dtype = dtype_of(artifact)
    vocab = min(v for v in (vocab_size(model), vocab_size(artifact), facts.base_vocab) if v) \
        if vocab_size(model) else 2
    batches, facts.probe_source = probe_batches(trainer, batch, vocab)
    trained_logits = logits_of(model, batches, vocab)
    if peft:
        facts.lora = read_lora(model)
        with model.disable_adapter():
            disabled = logits_of(model, batches, vocab)
        facts.comparisons["effect"] = compare("trained vs adapter disabled", trained_logits, disabled, batches)
    artifact_logits = logits_of(artifact, batches, vocab)
    label = {"adapter": "reloaded adapter", "merged": "reloaded merged model", "model": "merged model"}[kind]
    facts.comparisons["artifact"] = compare(f"trained vs {label}", trained_logits,
                                            artifact_logits, batches)
    if kind != "adapter" and peft:
        facts.merge = merge_fidelity(model, artifact)
    if kind == "adapter":
        with artifact.disable_adapter():
            artifact_base = logits_of(artifact, batches, vocab)
        facts.comparisons["artifact_effect"] = compare("reloaded adapter vs its base", artifact_logits,
                                                       artifact_base, batches)
        facts.differing = differing_parameters(model, artifact)
    facts.embedding_params = embedding_names(model)
    facts.ties = {"trained": tied(model), "reloaded": tied(artifact)}
    if path is not None:
        del artifact  # the second copy goes now, not at the next collection
    return model, trainer, facts
