"""Known warnings that announce a failure: one small signature each, beside the exception rules.

A warning signature receives the warning's text and where it came from (a ``warnings`` category
name or a logger name) and returns a :class:`Diagnosis` or None. Register with
``@warning_signature("stable-id", source=...)``; the id is the diagnosis' ``signature``.
``source`` names the channel the library really uses: the ``warnings`` module (``"warnings"``)
or a logger (``"logging:transformers"``), so the notebook front end knows where to listen.
The diagnosis' ``exception`` field carries the warning's first line (``UserWarning: ...``).
"""
from __future__ import annotations

import ast
import re
from collections.abc import Callable
from dataclasses import dataclass

from ..document.outward import outward
from .diagnosis import Diagnosis

WarningRule = Callable[[str, str], "Diagnosis | None"]


@dataclass(frozen=True)
class WarningSignature:
    id: str
    source: str  # "warnings" or "logging:<logger name>": the channel the library emits it on
    match: WarningRule


WARNING_SIGNATURES: dict[str, WarningSignature] = {}


def warning_signature(signature: str, source: str) -> Callable[[WarningRule], WarningRule]:
    if source != "warnings" and not source.startswith("logging:"):
        raise ValueError(f"source must be 'warnings' or 'logging:<logger>', got {source!r}")

    def register(func: WarningRule) -> WarningRule:
        if signature in WARNING_SIGNATURES:
            raise ValueError(f"duplicate warning signature id {signature!r}")
        WARNING_SIGNATURES[signature] = WarningSignature(signature, source, func)
        return func

    return register


def logger_names() -> list[str]:
    """The loggers the registered signatures listen on (``["bitsandbytes", "transformers"]``)."""
    return sorted({s.source.split(":", 1)[1] for s in WARNING_SIGNATURES.values() if s.source.startswith("logging:")})


def diagnose_warning(text: str, origin: str) -> Diagnosis | None:
    """The diagnosis of a known warning, or None. ``origin``: the category or logger name it came with."""
    if not isinstance(text, str):
        raise TypeError(f"diagnose_warning() needs the warning's text, got {type(text).__name__}")
    for signature in WARNING_SIGNATURES.values():
        diagnosis = signature.match(text, origin)
        if diagnosis is not None:
            return diagnosis
    return None


def _first_line(origin: str, text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return f"{origin}: {outward(line)[:300]}"  # redacted whole, then cut: half a token has no shape left


def _diagnosis(signature: str, text: str, origin: str, title: str, detail: str, fixes=(), **evidence) -> Diagnosis:
    evidence = {"warning_origin": origin, **evidence}
    return Diagnosis(signature, title, detail, _first_line(origin, text), list(fixes), evidence)


# trl's DataCollatorForCompletionOnlyLM (trl < 0.20; transformers-based SFT recipes copy it):
# warnings.warn(f"Could not find response key `{template}` in the following instance: {text}.
# This instance will be ignored in loss calculation. ...", UserWarning)
_RESPONSE_KEY = re.compile(r"Could not find (?:response|instruction) key [`'\"]?(?P<key>.*?)[`'\"]? in the following instance"
                           r".*?This instance will be ignored in loss calculation", re.S)


@warning_signature("response-key-not-found", source="warnings")
def response_key_not_found(text: str, origin: str):
    match = _RESPONSE_KEY.search(text)
    if not match:
        return None
    return _diagnosis(
        "response-key-not-found", text, origin,
        "A completion-only collator found no response template in a row: that row trains on nothing",
        "The collator sets every label of the row to -100 when it cannot find the response template's "
        "token ids in it (the template tokenises differently inside the text than alone, or truncation "
        "cut it off). The row then adds no supervised token; when every row of a batch is like this the "
        "mean loss is 0/0 and turns NaN. Pass the template as token ids taken from a tokenised example "
        "(with its leading context, e.g. the tokens of \"\\n### Response:\"), or raise max_length. "
        "%precision_check with --batch shows the share of rows without a supervised token.",
        response_key=match.group("key"))


# torch.utils.checkpoint (reentrant): warnings.warn("None of the inputs have requires_grad=True.
# Gradients will be None", stacklevel=2)
@warning_signature("checkpoint-inputs-no-grad", source="warnings")
def checkpoint_inputs_no_grad(text: str, origin: str):
    if "None of the inputs have requires_grad=True" not in text or "Gradients will be None" not in text:
        return None
    return _diagnosis(
        "checkpoint-inputs-no-grad", text, origin,
        "Gradient checkpointing gets inputs that need no grad: the checkpointed layers will get no gradients",
        "Reentrant gradient checkpointing only backpropagates into a segment whose inputs require grad. "
        "With a frozen base model (LoRA/PEFT, or frozen embeddings) the hidden states entering the first "
        "checkpointed layer do not, so the adapters inside the checkpointed layers get no gradient (loss "
        "flat, or 'element 0 of tensors does not require grad' at backward). Make the embedding output "
        "require grad (model.enable_input_require_grads()), or checkpoint with use_reentrant=False.",
        fixes=["enable-input-require-grads"])


# transformers <= 4.5x, Gemma2ForCausalLM.forward: logger.warning_once("It is strongly recommended to
# train Gemma2 models with the `eager` attention implementation instead of `sdpa`. ...")
_GEMMA2_EAGER = re.compile(r"strongly recommended to train Gemma ?2 models with the `?eager`? attention "
                           r"implementation instead of `?(?P<impl>[\w-]+)`?", re.I)


@warning_signature("gemma2-eager-attention", source="logging:transformers")
def gemma2_eager_attention(text: str, origin: str):
    match = _GEMMA2_EAGER.search(text)
    if not match:
        return None
    return _diagnosis(
        "gemma2-eager-attention", text, origin,
        f"Gemma 2 is training with {match.group('impl')} attention, which ignores its attention softcapping",
        "Gemma 2 caps its attention logits (attn_logit_softcapping) and only the eager implementation "
        "applies the cap; SDPA and FlashAttention skip it, so training runs on logits the model never saw "
        "in pre-training: the loss drifts or diverges, and in fp16 the uncapped logits can overflow. Load "
        "the model with attn_implementation=\"eager\" (or set model.config._attn_implementation = \"eager\" "
        "before training).",
        attn_implementation=match.group("impl"))


# bitsandbytes.nn.modules.Linear4bit.set_compute_type: logger.warning("Input type into Linear4bit is
# torch.float16, but bnb_4bit_compute_dtype=torch.float32 (default). This will lead to slow ...")
_LINEAR4BIT = re.compile(r"Input type into Linear4bit is (?P<input>torch\.\w+), but "
                         r"bnb_4bit_compute_dtype=(?P<compute>torch\.\w+)")


@warning_signature("linear4bit-input-dtype", source="logging:bitsandbytes")
def linear4bit_input_dtype(text: str, origin: str):
    match = _LINEAR4BIT.search(text)
    if not match:
        return None
    return _diagnosis(
        "linear4bit-input-dtype", text, origin,
        f"4-bit layers get {match.group('input')} inputs but compute in {match.group('compute')}",
        "bitsandbytes' Linear4bit dequantises its weights and casts its input to its own compute dtype "
        "(bnb_4bit_compute_dtype, fp32 by default). The model's activations arrive in fp16, so every 4-bit "
        "matmul converts them to fp32 and back: slow, and a sign the quantisation config and the training "
        "precision disagree. Load with BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=...) "
        "set to the precision you train in (bf16 on GPUs that have it natively, else fp16).",
        input_dtype=match.group("input"), compute_dtype=match.group("compute"))


# torch.cuda (_check_cubins and, in newer releases, _warn_unsupported_code) on a GPU the torch build has no
# kernels for: "NVIDIA GeForce RTX 5090 with CUDA capability sm_120 is not compatible with the current PyTorch
# installation. The current PyTorch install supports CUDA capabilities sm_50 ... sm_90." / "Found GPU0 NVIDIA
# GeForce RTX 5090 which is of compute capability (CC) 12.0. ... does not include kernels for this GPU."
_ARCH_OLD = re.compile(r"(?P<gpu>\S.*?) with CUDA capability sm_(?P<sm>\d+) is not compatible with the current PyTorch "
                       r"installation\.\s*The current PyTorch install supports CUDA capabilities (?P<archs>[^.\n]*)")
_ARCH_NEW = re.compile(r"Found GPU\d+ (?P<gpu>.+?) which is of compute capability \(CC\) (?P<major>\d+)\.(?P<minor>\d+)\."
                       r".*?(?:does not include kernels for this GPU|No published PyTorch CUDA builds)", re.S)
_ARCH_INSTALL = re.compile(r"pip install torch==\S+ --index-url \S+")


@warning_signature("cuda-arch-not-compatible", source="warnings")
def cuda_arch_not_compatible(text: str, origin: str):
    """torch warns at start-up that the GPU's architecture (e.g. sm_120, an RTX 50xx) is not in its build ("is not compatible with the current PyTorch installation"): every CUDA op will fail with "no kernel image is available"."""
    old, new = _ARCH_OLD.search(text), _ARCH_NEW.search(text)
    if old is not None:
        gpu, sm, built = old.group("gpu").strip(), f"sm_{old.group('sm')}", old.group("archs").split()
    elif new is None:
        return None
    else:
        gpu, sm, built = new.group("gpu").strip(), f"sm_{new.group('major')}{new.group('minor')}", []
    install = _ARCH_INSTALL.findall(text)
    return _diagnosis(
        "cuda-arch-not-compatible", text, origin,
        f"the installed torch has no kernels for the {gpu} ({sm}): every CUDA op on it will fail",
        f"torch warns when it starts on a GPU whose architecture ({sm}) its build carries no kernels for; the first "
        "CUDA op then raises \"no kernel image is available for execution on the device\". Builds made with CUDA "
        "12.6 and older stop at sm_90, so Blackwell GPUs (B200 sm_100, RTX 50xx sm_120) need a torch from the cu128 "
        "index or newer; builds for CUDA 12.8 and newer dropped Volta (sm_70). "
        + (f"torch names the build to install: {install[0]}. " if install else
           "Install a torch built for a CUDA version that carries it (pip install torch --index-url "
           "https://download.pytorch.org/whl/cu128 for Blackwell). ")
        + "Then restart the kernel: torch is already loaded.",
        gpu=gpu, compute_capability=sm, torch_arch_list=built, install=install)


# transformers.utils.chat_template_utils: logger.warning_once("return_assistant_tokens_mask==True but chat template
# does not contain `{% generation %}` keyword.")
@warning_signature("generation-keyword-missing", source="logging:transformers")
def assistant_mask_no_generation_warning(text: str, origin: str):
    """transformers warns that `return_assistant_tokens_mask` needs `{% generation %}` in the chat template: the assistant mask will be all zeros."""
    if "return_assistant_tokens_mask" not in text or "generation %}" not in text:
        return None
    return _diagnosis(
        "generation-keyword-missing", text, origin,
        "The chat template has no {% generation %} block: the assistant mask is all zeros",
        "apply_chat_template(return_assistant_tokens_mask=True) marks the tokens inside {% generation %}..."
        "{% endgeneration %}; without the block no token is an assistant token, so assistant-only loss "
        "supervises nothing (every label -100, a NaN or zero loss). Add the block around each assistant reply "
        "and its end-of-turn token. nbguard.audit(trainer) reports the supervised share per role.")


# transformers tokenization_utils_tokenizers._patch_mistral_regex: logger.warning("The tokenizer you are loading
# from '...' with an incorrect regex pattern: ... You should set the `fix_mistral_regex=True` flag ...")
@warning_signature("mistral-regex-warning", source="logging:transformers")
def mistral_regex_warning(text: str, origin: str):
    """transformers' Mistral tokenizer regex warning; the audit rule `mistral-regex-unfixed` tokenises the data with and without `fix_mistral_regex` to say whether it changes the ids."""
    if "incorrect regex pattern" not in text or "fix_mistral_regex" not in text:
        return None
    return _diagnosis(
        "mistral-regex-warning", text, origin,
        "Mistral tokenizer loaded with the old pre-tokenizer regex",
        "Whether it matters depends on the text: digits, punctuation and line breaks may split differently from "
        "the pattern the model was trained with. nbguard.audit(trainer) tokenises the sampled rows with and "
        "without the fix and says whether any id differs (rule mistral-regex-unfixed); to be safe, reload with "
        "AutoTokenizer.from_pretrained(..., fix_mistral_regex=True) before building the dataset.")


# trl.trainer.sft_trainer (prompt-completion rows): logger.warning_once("The tokenized prompt is not a prefix of the
# tokenized prompt+completion, usually because ... this end of the prompt is left out of the training sequence:
# {processing_class.decode(prompt_ids[prompt_len:])!r}. ..."); accelerate's logger prefixes "[RANK n] "
_PROMPT_NOT_PREFIX = re.compile(r"tokenized prompt is not a prefix of the tokenized prompt\+completion.*?"
                                r"left out of the training sequence: (?P<dropped>'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\")",
                                re.S)


# the fix for prompts that end in whitespace, as code a user runs on the raw prompt-completion dataset
MOVE_WHITESPACE = (
    "Move the whitespace to the start of the completion before tokenizing: dataset = dataset.map("
    "lambda row: {\"prompt\": row[\"prompt\"].rstrip(), \"completion\": row[\"prompt\"][len(row[\"prompt\"]"
    ".rstrip()):] + row[\"completion\"]}), and prompt the trained model without the trailing whitespace.")


def is_whitespace(text: object) -> bool:
    return isinstance(text, str) and text != "" and text.strip() == ""


def prompt_cut_cause(dropped: object) -> tuple[bool, str]:
    """(whether the dropped end is whitespace, what cut it and the fix) for a prompt whose tokenized end is not in
    the tokenized prompt+completion (the warning's explanation and the audit rule ``prompt-end-not-trained``'s)."""
    whitespace = is_whitespace(dropped)
    if whitespace:
        return True, (
            f"The prompts end in whitespace ({dropped!r}) that the tokenizer merges into the completion's first "
            "token, so the prompt alone ends on a token the prompt+completion never contains. The training rows "
            "start the completion where the two diverge (as TRL does), so that token is in none of them, but at "
            "inference the same prompt ends on it: the model continues from a context it was never trained on. "
            + MOVE_WHITESPACE)
    return False, (
        f"The prompt alone tokenizes to {dropped!r} at its end, which the prompt+completion does not contain: "
        "the chat template renders the prompt with add_generation_prompt=True differently from the prompt "
        "followed by the completion (an empty thinking block, a different header), or tokens merge across "
        "the boundary. The training rows leave that end out, but at inference the model sees it. Use a chat template "
        "that renders the prompt the same way in both cases, or end the prompt on a token boundary.")


@warning_signature("prompt-not-a-prefix", source="logging:trl")
def prompt_not_a_prefix(text: str, origin: str):
    """TRL's SFTTrainer cut the end of the prompt out of the training sequences: the model trains on a context it
    never sees at inference (a prompt ending in whitespace that merges into the completion's first token, or a
    chat template that renders the prompt alone differently)."""
    match = _PROMPT_NOT_PREFIX.search(text)
    if not match:
        return None
    try:
        dropped = ast.literal_eval(match.group("dropped"))
    except (ValueError, SyntaxError):
        dropped = match.group("dropped")
    whitespace, cause = prompt_cut_cause(dropped)
    return _diagnosis(
        "prompt-not-a-prefix", text, origin,
        f"TRL left the end of the prompt ({dropped!r}) out of the training sequences",
        cause + " TRL warns once per process, but the cause is usually in every row; nbguard.audit(trainer) "
        "counts the rows (rule prompt-end-not-trained).",
        dropped_text=dropped, whitespace_only=whitespace)
