"""Known error signatures, one small function each.

A rule receives one exception of the chain and returns a :class:`Diagnosis` or None. Register
with ``@rule("stable-id")``; the id is the diagnosis' ``signature`` and never changes once shipped.
"""
from __future__ import annotations

import re
from collections.abc import Callable

from .. import fixes as fix_registry
from ..hardware import Hardware, detect
from ..introspect.cuda_archs import CudaBuild, read_cuda_build, torch_remedy
from .diagnosis import Diagnosis, exception_text
from .frames import ModelFacts, model_facts
from .match import normalised
from .match import search as match

Rule = Callable[[BaseException], "Diagnosis | None"]
RULES: dict[str, Rule] = {}


def rule(signature: str) -> Callable[[Rule], Rule]:
    def register(func: Rule) -> Rule:
        if signature in RULES:
            raise ValueError(f"duplicate explainer rule id {signature!r}")
        func.signature = signature  # type: ignore[attr-defined]  # the id travels with the function
        RULES[signature] = func
        return func

    return register


def _diagnosis(signature: str, exc: BaseException, title: str, detail: str, fixes=(), options=None, **evidence):
    fixes = list(fixes)
    options = dict(options or {})
    for fix_id in fixes:
        if fix_id not in options:
            options[fix_id] = _options_here(fix_id)
    return Diagnosis(signature, title, detail, exception_text(exc), fixes, evidence, options)


def _options_here(fix_id: str) -> dict:
    """The fix's own options for this machine (switch-precision: bf16 where native, else fp32)."""
    try:
        return fix_registry.get(fix_id).options_for()
    except Exception:  # hardware detection must never turn an explanation into a second error
        return {}


# pytorch#139298 / trl#7181: the cuDNN SDPA backward returns NaN on Hopper (sm90) with a padding mask on
# some torch 2.5-2.7 builds. Registered before anomaly-nan-output, which would match the same message.
_CUDNN_NAN = re.compile(r"Function '(ScaledDotProductCudnnAttentionBackward\d*)' returned nan values")


@rule("cudnn-attention-backward-nan")
def cudnn_attention_backward_nan(exc):
    """Anomaly mode names `ScaledDotProductCudnnAttentionBackward0` as returning NaN: the cuDNN SDPA backward on Hopper with a padding mask (torch >= 2.5), not the model."""
    match = _CUDNN_NAN.search(str(exc))
    if not match:
        return None
    detail = (
        "The NaN comes from PyTorch's cuDNN scaled-dot-product-attention backward, not from the model: on Hopper "
        "GPUs (sm90) with a padding attention mask, several torch releases return NaN gradients from this kernel "
        "(pytorch#139298). Turn the cuDNN backend off (torch.backends.cuda.enable_cudnn_sdp(False)) so SDPA uses "
        "the flash or memory-efficient kernel, or load the model with another attention implementation."
    )
    return _diagnosis("cudnn-attention-backward-nan", exc, "NaN from the cuDNN attention backward (Hopper)", detail,
                      ["disable-cudnn-sdp"], function=match.group(1))


_ANOMALY_NAN = re.compile(r"Function '(\w+)' returned nan values in its (\d+)(?:st|nd|rd|th) output")


@rule("anomaly-nan-output")
def anomaly_nan_output(exc):
    match = _ANOMALY_NAN.search(str(exc))
    if not match:
        return None
    function, index = match.group(1), int(match.group(2))
    compiled = function.startswith("Compiled")
    where = (
        "inside a torch.compile region, so anomaly mode cannot say which module it was"
        if compiled
        else f"in the backward of {function}, which names an operation, not the module it ran in"
    )
    detail = (
        f"torch.autograd.detect_anomaly saw a NaN gradient {where}. Anomaly mode also slows every "
        "step 1.5-3x. nbguard.watch (or %nanwatch) checks each optimizer step for almost nothing and, "
        "on the first bad step, replays it eagerly with hooks on every module to name the module where "
        "the NaN was born, in forward or backward: turn anomaly mode off and run "
        "`watch = nbguard.watch(trainer)` (or `nbguard.watch(model, optimizer=optimizer)`), then "
        "look at `watch.events[0].origins`."
    )
    return _diagnosis(
        "anomaly-nan-output", exc, f"NaN gradient in the backward of {function}", detail,
        function=function, output_index=index, compiled=compiled,
    )


_CACHE_FLOAT = re.compile(r"'(\w*Cache)' object has no attribute 'float'")


@rule("cache-float-crash")
def cache_float_crash(exc):
    match = _CACHE_FLOAT.search(str(exc)) if isinstance(exc, AttributeError) else None
    if not match:
        return None
    detail = (
        f"During evaluation the model returned its key/value cache ({match.group(1)}) among its outputs, "
        "and accelerate's conversion of outputs to float32 (used with bf16/fp16 mixed precision) called "
        ".float() on it. This happens with transformers 4.50.x caches that carry a dtype. The cache is "
        "of no use while training: turn it off with model.config.use_cache = False."
    )
    return _diagnosis(
        "cache-float-crash", exc, f"Evaluation crashed converting the {match.group(1)} to float32", detail,
        ["disable-use-cache"], cache_class=match.group(1),
    )


_UNSCALE_BF16 = re.compile(
    r"'_amp_foreach_non_finite_check_and_unscale_cuda' not implemented for 'bfloat16'")


@rule("fp16-unscale-error")
def fp16_unscale_error(exc: BaseException) -> Diagnosis | None:
    message = str(exc)
    if "attempting to unscale fp16 gradients" in normalised(message):
        grad_dtype = "float16"
    elif match(_UNSCALE_BF16, message):
        grad_dtype = "bfloat16"
    else:
        return None
    if grad_dtype == "float16":
        what = ("refuses fp16 gradients: the parameters being trained are stored in float16 (for example a model "
                "loaded with torch_dtype=torch.float16, LoRA adapters included).")
    else:
        what = ("has no CUDA kernel for bfloat16 gradients: the parameters being trained are stored in bfloat16 "
                "(a bf16 checkpoint loaded as is, adapters included) while TrainingArguments say fp16=True.")
    detail = (
        f"The GradScaler of fp16 mixed precision unscales gradients in place and {what} Mixed precision wants "
        "float32 trainable weights; autocast still runs the matmuls in fp16. Upcast the trainable parameters "
        "to float32" + (", or train with bf16=True instead of fp16=True where the GPU has native bf16 "
                        "(compute capability 8.0 or newer)." if grad_dtype == "bfloat16" else ".")
    )
    return _diagnosis(
        "fp16-unscale-error", exc, f"fp16 mixed precision with {grad_dtype} trainable parameters", detail,
        ["upcast-trainable-fp32"], grad_dtype=grad_dtype,
    )


# Written against the normalised message (lower case, no c10::/at::), as pasted messages arrive.
_DTYPE_MISMATCH = (
    re.compile(r"expected (?:m1|mat1) and (?:m2|mat2) to have the same dtype, but got: (\w+) != (\w+)"),
    re.compile(r"expected (?:m1|mat1) and (?:m2|mat2) to have the same dtype"),
    re.compile(r"mat1 and mat2 must have the same dtype"),
    re.compile(r"expected scalar type (\w+) but found (\w+)"),
)


def _dtype_name(text: str) -> str:
    return {"float": "float32", "half": "float16", "bfloat16": "bfloat16", "double": "float64"}.get(text, text)


SHOWN_MODULES = 8  # module names a detail lists before it says how many more there are


def _first_of(names: list[str]) -> str:
    """The first names, and how many more (a list cut short says so)."""
    more = len(names) - SHOWN_MODULES
    return ", ".join(names[:SHOWN_MODULES]) + (f" and {more} more" if more > 0 else "")


def _mismatch_cause(facts: ModelFacts | None, dtypes: list[str]) -> tuple[str, str]:
    """(cause, what to do) from what the failing model really held."""
    if facts is None:
        return "unknown", (
            "The traceback went through no torch module, so nbguard cannot see which part holds which dtype. "
            "Print {name: p.dtype for name, p in model.named_parameters()} and the dtype of the inputs, and "
            "give the odd one the dtype of the rest."
        )
    layer = f"{facts.layer_name or facts.layer} ({facts.layer}, weights {facts.weight_dtype})"
    if facts.compute_dtypes and facts.input_dtype in facts.compute_dtypes and facts.input_dtype != facts.weight_dtype:
        return "4bit-compute-dtype", (
            f"The model holds bitsandbytes 4-bit layers that compute in {', '.join(facts.compute_dtypes)} "
            f"(bnb_4bit_compute_dtype), and {layer} received a {facts.input_dtype} tensor, the 4-bit compute "
            "dtype, while its own weights are another: part of the model runs in the compute dtype and part "
            f"in {facts.weight_dtype}. Load the model "
            f"with bnb_4bit_compute_dtype={facts.weight_dtype} so the 4-bit layers hand on the dtype the rest of "
            "the model holds (or set each Linear4bit's compute_dtype to it)."
        )
    if set(facts.param_dtypes) == {"float32"} and facts.input_dtype in ("float16", "bfloat16"):
        return "forced-fp32", (
            f"Every parameter of {facts.model} is float32 (the model was loaded or cast to float32, e.g. by "
            f"model.float() or prepare_model_for_kbit_training), but {layer} was given a {facts.input_dtype} "
            "tensor from outside the model or from an earlier half-precision step. Cast the inputs "
            "(inputs_embeds, pixel_values) to float32, or run the forward under torch.autocast so both sides meet "
            "in one dtype."
        )
    if facts.minority:
        odd = "; ".join(f"{d}: {_first_of(names)}" for d, names in facts.minority.items())
        return "mixed-dtypes", (
            f"{facts.model} holds parameters of several dtypes ({', '.join(facts.param_dtypes)}); the fewer ones "
            f"are {odd}. {layer} met an input of another dtype. Cast the odd modules to the dtype of the rest "
            "(module.to(dtype)), or train under mixed precision, where autocast makes both sides meet in one dtype."
        )
    return "input-dtype", (
        f"{layer} was given a {facts.input_dtype} input while the whole model holds {', '.join(facts.param_dtypes)}. "
        "Cast the input to the model's dtype, or run under torch.autocast."
    )


@rule("matmul-dtype-mismatch")
def matmul_dtype_mismatch(exc: BaseException) -> Diagnosis | None:
    found = next((m for m in (match(p, str(exc)) for p in _DTYPE_MISMATCH) if m), None)
    if not found:
        return None
    dtypes = [_dtype_name(g) for g in found.groups()]
    seen = f" ({' and '.join(dtypes)})" if dtypes else ""
    facts = model_facts(exc)
    cause, todo = _mismatch_cause(facts, dtypes)
    detail = (
        f"Two tensors of different dtypes{seen} met in a matrix multiply. Outside autocast PyTorch does not "
        f"convert between float32 and float16/bfloat16. {todo}"
    )
    evidence: dict[str, object] = {"dtypes": dtypes, "cause": cause}
    if facts is not None:
        evidence.update({"layer": facts.layer_name or facts.layer, "layer_class": facts.layer,
                         "weight_dtype": facts.weight_dtype, "input_dtype": facts.input_dtype,
                         "parameter_dtypes": facts.param_dtypes})
        if facts.compute_dtypes:
            evidence["linear4bit_compute_dtypes"] = facts.compute_dtypes
        if facts.minority:
            evidence["minority_dtype_modules"] = {d: names[:4 * SHOWN_MODULES] for d, names in facts.minority.items()}
            evidence["minority_dtype_module_counts"] = {d: len(names) for d, names in facts.minority.items()}
    # float32 weights fed half-precision inputs: the one cast the detail asks for, as a cell
    fixes = ["cast-inputs-to-float32"] if cause == "forced-fp32" else []
    return _diagnosis("matmul-dtype-mismatch", exc, "Matrix multiply of mismatched dtypes" + seen, detail, fixes,
                      **evidence)


@rule("no-grad-input")
def no_grad_input(exc):
    if "element 0 of tensors does not require grad" not in normalised(str(exc)):
        return None
    detail = (
        "backward() was called on a loss that no trainable parameter contributed to. With gradient "
        "checkpointing on a PEFT (LoRA) model, the frozen embeddings return a tensor that does not "
        "require grad, so the checkpointed blocks record no graph. Make the embedding outputs require "
        "grad (model.enable_input_require_grads()), or check that some parameters are trainable."
    )
    return _diagnosis(
        "no-grad-input", exc, "The loss has no gradient path to a trainable parameter", detail,
        ["enable-input-require-grads"],
    )


_BF16_UNSUPPORTED = re.compile(
    r"doesn't support bf16|does not support bfloat16|bf16 (?:is )?not supported|"
    r"type bf16 not supported|bfloat16 is not supported|bf16 mixed precision requires|"
    r"bfloat16 is only supported on gpus with compute capability of at least 8\.0"
)
_YOUR_GPU = re.compile(r"Your\s+(.+?)\s+GPU\s+has\s+compute\s+capability\s+(\d+\.\d+)", re.IGNORECASE)


@rule("bf16-unsupported")
def bf16_unsupported(exc: BaseException) -> Diagnosis | None:
    if not match(_BF16_UNSUPPORTED, str(exc)):
        return None
    gpu = _YOUR_GPU.search(str(exc))
    evidence = {"gpu": gpu.group(1), "compute_capability": gpu.group(2)} if gpu else {}
    detail = (
        "bf16 was asked for on a device without native bf16 (native bf16 needs an NVIDIA GPU of compute "
        "capability 8.0 or newer: A100, L4, A10G, RTX 30xx/40xx, H100; a T4 or V100 has none, even where "
        "torch.cuda.is_bf16_supported() answers True by emulation). Train in fp32 there (fp16 only for "
        "models pretrained in fp16), or use a GPU with native bf16. When the message comes from vLLM (TRL's "
        "use_vllm, Unsloth's fast_inference), give vLLM dtype=\"float16\" or \"float32\" as well."
    )
    return _diagnosis(
        "bf16-unsupported", exc, "bf16 is not supported on this device", detail, ["switch-precision"],
        options={"switch-precision": {"to": "fp32"}}, **evidence,
    )


_HALF_OVERFLOW = re.compile(r"value cannot be converted to type half without overflow")


@rule("half-overflow-value")
def half_overflow_value(exc: BaseException) -> Diagnosis | None:
    if not match(_HALF_OVERFLOW, str(exc)):
        return None
    detail = (
        "Code wrote a constant larger than 65504 into a float16 tensor: typically an attention mask filled "
        "with -1e9 or torch.finfo(torch.float32).min (custom or older remote model code) while the model runs "
        "in float16. fp16 cannot hold it; bfloat16 and float32 can. Run the model in bf16 where the GPU has "
        "it, else fp32, or fill with torch.finfo(tensor.dtype).min in your own code."
    )
    return _diagnosis("half-overflow-value", exc, "A constant too large for float16", detail, ["switch-precision"])


_HALF_NOT_IMPLEMENTED = re.compile(r"'(\w+)' not implemented for 'half'")
_CPU_KERNELS = ("LayerNormKernelImpl",)  # CPU kernels whose names do not say cpu


@rule("half-op-on-cpu")
def half_op_on_cpu(exc: BaseException) -> Diagnosis | None:
    found = match(_HALF_NOT_IMPLEMENTED, str(exc))
    if not found:
        return None
    original = re.search(re.escape(found.group(1)), str(exc), re.IGNORECASE)  # the op as spelled
    op = original.group(0) if original else found.group(1)
    if "cpu" not in op.lower() and op not in _CPU_KERNELS:
        return None
    detail = (
        f"The CPU kernel {op} has no float16 version in this PyTorch: a float16 model is running on the CPU. "
        "Usually the runtime has no GPU (a Colab runtime without an accelerator) or the model was never moved "
        "with .to(\"cuda\"). Check torch.cuda.is_available(); on a CPU, load or cast the model in float32."
    )
    return _diagnosis(
        "half-op-on-cpu", exc, f"float16 model on a CPU ({op})", detail, ["switch-precision"],
        options={"switch-precision": {"to": "fp32"}}, op=op,
    )


_FLASH_AMPERE = re.compile(
    r"flashattention only supports ampere gpus or newer|flashattention\d? requires compute capability >= ?(\d+)")


@rule("flash-attention-unsupported")
def flash_attention_unsupported(exc: BaseException) -> Diagnosis | None:
    found = match(_FLASH_AMPERE, str(exc))
    if not found:
        return None
    need = int(found.group(1) or 8)
    gpus = "Ampere: A100, A10G, L4, RTX 30xx/40xx, H100; a T4 or V100 cannot run them" if need == 8 else "Hopper: H100"
    detail = (
        f"FlashAttention's kernels need an NVIDIA GPU of compute capability {need}.0 or newer ({gpus}). Load the "
        "model with attn_implementation=\"sdpa\" (PyTorch's fused attention, which runs on every GPU), or "
        "switch it on the loaded model."
    )
    return _diagnosis(
        "flash-attention-unsupported", exc, f"FlashAttention needs compute capability {need}.0 or newer", detail,
        ["set-attn-implementation"], options={"set-attn-implementation": {"to": "sdpa"}},
        min_compute_capability=f"{need}.0",
    )


_SDPA_SOFTCAP = re.compile(r"'sdpa' attention does not support 'softcap'")


@rule("softcap-unsupported-attention")
def softcap_unsupported_attention(exc: BaseException) -> Diagnosis | None:
    if not match(_SDPA_SOFTCAP, str(exc)):
        return None
    detail = (
        "The model caps its attention scores (attn_logit_softcapping, Gemma 2), which PyTorch's sdpa attention "
        "cannot do; only eager, flex_attention and FlashAttention apply it. Older transformers ran sdpa anyway "
        "and silently dropped the cap. Use eager attention for this model."
    )
    return _diagnosis(
        "softcap-unsupported-attention", exc, "sdpa attention cannot apply softcapping", detail,
        ["set-attn-implementation"], options={"set-attn-implementation": {"to": "eager"}},
    )


_INDEX_ASSERT = re.compile(r"srcindex < srcselectdimsize")
_DEVICE_ASSERT = re.compile(r"cuda error: device-side assert triggered")
_INDEX_CPU = re.compile(r"index out of range in self")


def _embedding_in_traceback(exc: BaseException) -> dict | None:
    """num_embeddings and the largest id of the nn.Embedding the traceback failed in, if it did."""
    import sys

    torch = sys.modules.get("torch")
    tb, found = exc.__traceback__, None
    while torch is not None and tb is not None:
        module = tb.tb_frame.f_locals.get("self")
        if isinstance(module, torch.nn.Embedding):
            ids = tb.tb_frame.f_locals.get("input")
            found = {"num_embeddings": module.num_embeddings}
            if isinstance(ids, torch.Tensor) and ids.numel() and not ids.is_floating_point() and ids.device.type == "cpu":
                found["max_token_id"] = int(ids.max())
        tb = tb.tb_next
    return found


@rule("token-ids-out-of-range")
def token_ids_out_of_range(exc: BaseException) -> Diagnosis | None:
    message = str(exc)
    if not (match(_INDEX_ASSERT, message) or match(_INDEX_CPU, message) or match(_DEVICE_ASSERT, message)):
        return None
    embedding = _embedding_in_traceback(exc)
    if match(_INDEX_ASSERT, message):
        certainty: str | None = "the embedding lookup's assert"
    elif match(_INDEX_CPU, message):
        if embedding is None:  # index_select and friends say the same: not necessarily a token id
            return None
        certainty = "the embedding lookup on the CPU"
    else:
        certainty = None
    if certainty is None:
        detail = (
            "A CUDA kernel's assert fired; the message does not say which. In fine-tuning it is most often a "
            "token id at or above the embedding's size (tokens added to the tokenizer without "
            "model.resize_token_embeddings(len(tokenizer))), or a label outside the vocabulary. After a "
            "device-side assert the CUDA context is unusable: restart the kernel, run once with "
            "CUDA_LAUNCH_BLOCKING=1 (or on the CPU, which names the failing operation), and run "
            "nbguard.audit(trainer, batch=batch), which compares a batch's ids with the embedding."
        )
    else:
        detail = (
            f"A token id reached {certainty} at or above the number of embedding rows: tokens were added to "
            "the tokenizer without model.resize_token_embeddings(len(tokenizer)). On a GPU this surfaces as "
            "\"CUDA error: device-side assert triggered\" (srcIndex < srcSelectDimSize) and the kernel must be "
            "restarted. Resize the embeddings; new rows start at the mean of the trained rows."
        )
    return _diagnosis(
        "token-ids-out-of-range", exc, "Token id beyond the embedding matrix" if certainty else
        "CUDA device-side assert (often a token id beyond the embedding)", detail,
        ["resize-token-embeddings"], certain=certainty is not None, **(embedding or {}),
    )


@rule("sampling-nonfinite-probs")
def sampling_nonfinite_probs(exc):
    if "probability tensor contains either" not in normalised(str(exc)):
        return None
    detail = (
        "Sampling (generate with do_sample=True, or torch.multinomial) got logits that were NaN or Inf. "
        "In half precision this is usually an activation overflow: models pretrained in bf16 (Gemma and "
        "others) exceed float16's limit of 65504. Run the model in bf16 or fp32, or find the module with "
        "nbguard.audit(model, probe=True)."
    )
    return _diagnosis(
        "sampling-nonfinite-probs", exc, "Sampling from NaN/Inf probabilities", detail, ["switch-precision"],
    )


@rule("loss-scale-minimum")
def loss_scale_minimum(exc):
    if "loss scale already at minimum" not in normalised(str(exc)):
        return None
    detail = (
        "The dynamic loss scaler of fp16 training (DeepSpeed or apex) halved its scale on every step "
        "because the gradients overflowed every time, until it hit its floor: fp16 cannot hold this "
        "model's activations or gradients. Train in bf16 where the GPU has it, else fp32, or lower the "
        "learning rate if the loss diverged first."
    )
    return _diagnosis(
        "loss-scale-minimum", exc, "fp16 loss scale collapsed to its minimum", detail,
        ["switch-precision", "lower-learning-rate"],
    )


@rule("nbguard-stopped")
def nbguard_stopped(exc):
    from ..errors import NonFiniteError

    if not isinstance(exc, NonFiniteError):
        return None
    event = getattr(exc, "event", None)
    if event is None:
        return _diagnosis("nbguard-stopped", exc, "nbguard stopped training", str(exc))
    origin = event.origins[0] if event.origins else None
    where = f" in {origin.module} ({origin.phase})" if origin is not None else ""
    detail = (
        f"The watch's 'stop' policy ended training at optimizer step {event.step}: {event.message}. "
        "The bad update was not applied, so the trainable weights are the last good ones. Look at "
        "watch.events[-1].origins for where the value was born, fix the cause, and continue training."
    )
    evidence = {"kind": event.kind, "step": event.step, "cause": event.cause}
    if origin is not None:
        evidence["origin"] = origin.to_dict()
    # the watch ran the candidate fixes on this step: offer the verified ones, and carry every verdict
    verification = event.evidence.get("verification")
    verified = [v for v in (verification or {}).get("verdicts", [])
                if v.get("verdict") == "verified" and v.get("fix") in fix_registry.FIXES]
    diagnosis = _diagnosis("nbguard-stopped", exc, f"Stopped at step {event.step}: {event.kind}{where}", detail,
                           [v["fix"] for v in verified], {v["fix"]: v.get("options") or {} for v in verified},
                           **evidence)
    diagnosis.verification = verification
    return diagnosis


# trl SFTTrainer with assistant_only_loss=True: RuntimeError("... at least one example has no assistant tokens ...
# missing the `{% generation %}` keyword") (trl 0.20-1.x) and ValueError("The chat template is not
# training-compatible (missing prefix-preservation or `{% generation %}` markers) ...") (trl 1.x).
@rule("assistant-mask-no-generation")
def assistant_mask_no_generation(exc):
    """TRL's assistant-only loss on a chat template without `{% generation %}`: the assistant mask is empty, so nothing (or everything) is supervised."""
    text = str(exc)
    if "generation %}" not in text or not ("no assistant tokens" in text or "not training-compatible" in text):
        return None
    detail = (
        "assistant_only_loss supervises exactly the tokens the chat template wraps in {% generation %}..."
        "{% endgeneration %}; this template has no such block (and TRL has no training version of it), so every "
        "label would be -100. Add the block around each assistant reply, including its end-of-turn token, and set "
        "it as tokenizer.chat_template; or train on the whole conversation (assistant_only_loss=False). "
        "nbguard.audit(trainer) reports the share of supervised tokens per role for the template you set."
    )
    return _diagnosis("assistant-mask-no-generation", exc,
                      "assistant_only_loss: the chat template marks no assistant tokens", detail)


# transformers Trainer.compute_loss: ValueError("The model did not return a loss from the inputs, only the
# following keys: logits. ..."); modelling code: ValueError("`token_type_ids` is required as a model input when training")
_REQUIRED_INPUT = re.compile(r"`(\w+)` is required as a model input when training|data was passed .* but `(\w+)` is missing")


@rule("model-returned-no-loss")
def model_returned_no_loss(exc):
    """The Trainer's "model did not return a loss", or a required input such as `token_type_ids` missing from the batch: the forward ran without labels or without an input the loss needs."""
    text = str(exc)
    required = _REQUIRED_INPUT.search(text)
    if required is None and "did not return a loss from the inputs" not in text:
        return None
    missing = next((g for g in required.groups() if g), None) if required is not None else None
    if missing is not None:
        title = f"the model needs {missing} in training and the batch has none"
        cause = (f"The processor or collator did not put {missing} into the batch (or "
                 "remove_unused_columns dropped it): build batches with the model's own processor and keep that column.")
    else:
        title = "the model returned no loss: the batch has no labels"
        cause = ("The batch reached the model without labels, so it computed logits only. Use a collator that adds "
                 "labels (DataCollatorForLanguageModeling(tokenizer, mlm=False) for a causal LM) or keep the labels "
                 "column (remove_unused_columns, label_names).")
    return _diagnosis("model-returned-no-loss", exc, title,
                      cause + " nbguard.audit(trainer) runs one dry forward on a sampled batch and says this before train().",
                      missing_input=missing)


# transformers GenericForSequenceClassification: ValueError("Cannot handle batch sizes > 1 if no padding token is defined.")
@rule("classifier-no-pad-token")
def classifier_no_pad_token(exc):
    """A sequence-classification head with no `pad_token_id`: "Cannot handle batch sizes > 1 if no padding token is defined"; it cannot find the last real token to pool."""
    if "Cannot handle batch sizes > 1 if no padding token is defined" not in str(exc):
        return None
    detail = (
        "A decoder classification / reward head scores each row's last non-pad token and needs "
        "model.config.pad_token_id to find it. Give the tokenizer a pad token distinct from EOS and set "
        "model.config.pad_token_id = tokenizer.pad_token_id (with pad == EOS the head would score the token before "
        "each final EOS)."
    )
    return _diagnosis("classifier-no-pad-token", exc, "the classification head has no pad_token_id", detail,
                      ["distinct-pad-token", "sync-pad-token-id"])


# transformers trainer_utils / quantizer_mxfp4 (gpt-oss): "... quantized with QuantizationMethod.MXFP4 but that
# quantization method do not support training" and "MXFP4 quantization don't support training".
@rule("mxfp4-not-trainable")
def mxfp4_not_trainable(exc):
    """An MXFP4-quantised checkpoint (gpt-oss) given to a trainer: transformers refuses to train that quantisation; dequantise at load or train adapters on a bf16 copy."""
    text = str(exc)
    if "MXFP4" not in text or "support training" not in text:
        return None
    detail = (
        "MXFP4 weights (gpt-oss checkpoints) cannot be trained. Load them dequantised "
        "(quantization_config=Mxfp4Config(dequantize=True), bf16, about 4x the memory) to fine-tune the whole "
        "model or LoRA on top; or, to save memory, dequantise and then quantise to 4-bit with bitsandbytes for QLoRA."
    )
    return _diagnosis("mxfp4-not-trainable", exc, "MXFP4-quantised weights cannot be trained", detail)


# torch DistributedDataParallel reducer: RuntimeError("Expected to mark a variable ready only once. This error is
# caused by one of the following reasons: 1) Use of a module parameter outside the `forward` function. ...")
@rule("ddp-variable-ready-twice")
def ddp_variable_ready_twice(exc):
    """DDP with reentrant gradient checkpointing (and LoRA or unused parameters): "Expected to mark a variable ready only once"; use non-reentrant checkpointing."""
    if "mark a variable ready only once" not in str(exc):
        return None
    detail = (
        "DDP with find_unused_parameters=True marked a parameter ready after the forward (it did not see it in "
        "the graph) and again when its gradient arrived. The usual cause in fine-tuning is reentrant activation "
        "checkpointing, which hides the checkpointed layers' parameters from that graph; the Trainer turns "
        "find_unused_parameters on for PEFT models. Checkpoint with use_reentrant=False "
        "(gradient_checkpointing_kwargs={'use_reentrant': False}) or set ddp_find_unused_parameters=False."
    )
    return _diagnosis("ddp-variable-ready-twice", exc, "DDP marked a parameter ready twice (reentrant checkpointing)",
                      detail, ["non-reentrant-checkpointing"])


# transformers VLMs (get_placeholder_mask): ValueError("Image features and image tokens do not match, tokens: 3,
# features: 4") (earlier: "Image features and image tokens do not match: tokens: 720, features 360").
_IMAGE_MISMATCH = re.compile(r"Image features and image tokens do not match[:,]? tokens: (\d+), features:? (\d+)")


@rule("vlm-image-tokens-mismatch")
def vlm_image_tokens_mismatch(exc):
    """A vision-language model's "Image features and image tokens do not match": truncation cut image placeholder tokens out of the text."""
    match = _IMAGE_MISMATCH.search(str(exc))
    if not match:
        return None
    tokens, features = int(match.group(1)), int(match.group(2))
    detail = (
        f"The batch holds {tokens} image placeholder tokens but the vision tower gave {features} features. "
        + ("Truncation cut placeholders the processor had expanded: raise max_length above the longest example with "
           "its image tokens, or drop examples that do not fit. " if tokens < features else
           "The text holds more placeholders than the images give features (a placeholder written by hand, or images "
           "dropped from the batch). ")
        + "nbguard.audit(trainer) counts both on sampled batches before training (rule vlm-image-tokens-truncated)."
    )
    return _diagnosis("vlm-image-tokens-mismatch", exc, "image tokens and image features do not match", detail,
                      image_tokens=tokens, image_features=features)


# The CUDA runtime's error, raised by torch (c10) and by any extension's first kernel launch on a GPU
# its build carries no kernels for: "CUDA error: no kernel image is available for execution on the device"
_NO_KERNEL_IMAGE = re.compile(r"no kernel image is available for execution on the device")
_EXTENSION_PACKAGES = {"bitsandbytes": "bitsandbytes", "flash_attn": "flash-attn", "xformers": "xformers"}


def _package_in_traceback(exc: BaseException) -> str | None:
    """The innermost CUDA extension package the traceback went through, if any."""
    found, tb = None, exc.__traceback__
    while tb is not None:
        module = str(tb.tb_frame.f_globals.get("__name__", ""))
        found = _EXTENSION_PACKAGES.get(module.split(".", 1)[0], found)
        tb = tb.tb_next
    return found


def _this_gpu_and_build() -> tuple[Hardware, CudaBuild] | None:
    """This machine's GPU and builds, or None without a GPU (or when the broken CUDA context cannot say)."""
    try:
        hardware = detect()
        return (hardware, read_cuda_build()) if hardware.compute_capability is not None else None
    except Exception:  # a CUDA context broken by the error itself: explain without the machine's facts
        return None


@rule("cuda-no-kernel-image")
def cuda_no_kernel_image(exc: BaseException) -> Diagnosis | None:
    """The CUDA runtime found no kernel for this GPU's architecture in torch or an extension: a build made before the GPU (Blackwell sm_100/sm_120 on a CUDA 12.6 build) or after it was dropped (sm_70 from CUDA 12.8+ builds)."""
    if not match(_NO_KERNEL_IMAGE, str(exc)):
        return None
    package = _package_in_traceback(exc)
    machine = _this_gpu_and_build()
    evidence: dict = {"raised_in": package or "torch"}
    here = ""
    if machine is not None and machine[0].compute_capability is not None:
        hardware, build = machine
        cc = machine[0].compute_capability
        sm = f"sm_{cc[0]}{cc[1]}"
        evidence.update(gpu=hardware.display_name, compute_capability=f"{cc[0]}.{cc[1]}",
                        torch=build.torch_version, torch_arch_list=[code.label for code in build.torch_codes])
        here = f" This machine's {hardware.display_name} is {sm}; torch {build.torch_version} carries " \
               f"{' '.join(evidence['torch_arch_list']) or 'no CUDA kernels'}."
        if package is None and not build.torch_runs_on(cc):
            here += " " + torch_remedy(build, cc)
    who = f"{package}'s compiled kernels" if package else "the installed torch (or an extension it called)"
    detail = (
        f"A CUDA kernel was launched on a GPU that {who} carry no code for. Every build is compiled for a list of "
        "GPU architectures: builds made with CUDA 12.6 and older stop at sm_90 (Hopper), so Blackwell GPUs (B200 "
        "sm_100, RTX 50xx sm_120) need builds made with CUDA 12.8 or newer; builds for CUDA 12.8 and newer dropped "
        f"Volta (V100, sm_70).{here} Install builds that carry the GPU's architecture (torch from the cu128 index or "
        "newer for Blackwell; bitsandbytes >= 0.45.3; a flash-attn or xformers wheel built for that CUDA), then "
        "restart the kernel. %precision_check names each installed build that lacks it before training.")
    return _diagnosis("cuda-no-kernel-image", exc, f"no CUDA kernels for this GPU in {package or 'torch'}",
                      detail, **evidence)
