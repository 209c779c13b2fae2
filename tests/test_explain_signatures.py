"""Issue 13 item 12: error signatures, on the real exception where this CPU machine raises it, else on the exact message.

Messages users paste arrive re-wrapped, with other quotes and namespaces; each exact message is also
tried in those pasted forms.
"""
from __future__ import annotations

import pytest
import torch

from nbguard import fixes
from nbguard.explainer import RULES, diagnose
from nbguard.explainer.match import normalised
from nbguard.testing import TINY_VOCAB, tiny_batch, tiny_llama


def raised(func) -> BaseException:
    try:
        func()
    except BaseException as exc:  # noqa: BLE001 - whatever the library raises
        return exc
    raise AssertionError("expected an exception")


# ---- real exceptions (CPU) ---------------------------------------------------------------------
def half_overflow():
    # What an fp16 model's mask code does with a float32-sized constant.
    torch.zeros(2, 4, dtype=torch.float16).masked_fill(torch.ones(2, 4, dtype=torch.bool), -1e9)


# transformers >= 5.x's own words (integrations/sdpa_attention.py); older releases (the Colab lane's
# 5.9) leave the scores uncapped instead of raising, so there the signature is tried on this text.
SDPA_SOFTCAP = ("`sdpa` attention does not support `softcap`. Try using `eager`, `flex_attention`, or the few FA "
                "kernels supporting it")


def softcap_with_sdpa():
    from test_rules_precision_audit import tiny_gemma2

    from nbguard.auditor.rules.attention import sdpa_raises_on_softcap

    tiny_gemma2("sdpa")(**tiny_batch())
    if not sdpa_raises_on_softcap():
        raise ValueError(SDPA_SOFTCAP)


def embedding_out_of_range():
    batch = tiny_batch()
    batch["input_ids"][0, 3] = TINY_VOCAB + 1  # a token added to the tokenizer, the model not resized
    tiny_llama()(**batch)


def mixed_dtype_model():
    model = tiny_llama(dtype=torch.bfloat16)
    model.lm_head.float()  # a head kept or re-created in float32 on a bf16 model, outside autocast
    model(**tiny_batch())


def norms_and_head_in_float32_model():
    """axolotl's case: the norms and the head in float32 (nine modules) on a bf16 model, outside autocast."""
    model = tiny_llama(dtype=torch.bfloat16, num_hidden_layers=4)
    for name, module in model.named_modules():
        if name.endswith("norm") or name.endswith("layernorm") or name == "lm_head":
            module.float()
    model(**tiny_batch())


def forced_fp32_model():
    model = tiny_llama()  # float32 everywhere
    model.model.layers[0].mlp(torch.randn(1, 4, 64, dtype=torch.bfloat16))


def grpo_reward_count():
    import tempfile
    from pathlib import Path

    from rl_helpers import grpo_trainer

    def one_score(completions, **kwargs):
        return [1.0]

    grpo_trainer(Path(tempfile.mkdtemp()), reward_funcs=one_score, max_steps=1).train()  # TRL's own ValueError


# ---- exact messages (CUDA-only kernels, libraries not installed here) ------------------------------
def message(exc_type, text):
    def make():
        raise exc_type(text)
    return make


UNSCALE_BF16 = "\"_amp_foreach_non_finite_check_and_unscale_cuda\" not implemented for 'BFloat16'"
ADDMM_HALF = "\"addmm_impl_cpu_\" not implemented for 'Half'"
VLLM_BF16 = ("Bfloat16 is only supported on GPUs with compute capability of at least 8.0. Your Tesla T4 GPU has "
             "compute capability 7.5. You can use float16 instead by explicitly setting the`dtype` flag in CLI, "
             "for example: --dtype=half.")
FLASH_AMPERE = "FlashAttention only supports Ampere GPUs or newer."
# transformers' own check (modeling_utils.py, _check_and_adjust_attn_implementation's FlashAttention branch)
FLASH_TRANSFORMERS = ("FlashAttention4 has been toggled on, but it cannot be used due to the following error: "
                      "FlashAttention4 requires compute capability >= 9, but found (8, 0) with compute capability 8.x")
SRC_INDEX = ("../aten/src/ATen/native/cuda/Indexing.cu:1289: indexSelectLargeIndex: block: [0,0,0], thread: [0,0,0] "
             "Assertion `srcIndex < srcSelectDimSize` failed.")
# the CUDA runtime's error on a GPU the build has no kernels for (a CUDA 12.6 torch on an RTX 5090)
NO_KERNEL = ("CUDA error: no kernel image is available for execution on the device\nCUDA kernel errors might be "
             "asynchronously reported at some other API call, so the stacktrace below might be incorrect.")
DEVICE_ASSERT = ("CUDA error: device-side assert triggered\nCUDA kernel errors might be asynchronously reported at "
                 "some other API call, so the stacktrace below might be incorrect.\nFor debugging consider passing "
                 "CUDA_LAUNCH_BLOCKING=1")

def recompile_limit_at_step_0():
    """FailOnRecompileLimitHit at step 0 (unsloth#6825): layers calling one compiled function, each with its own
    window, past a recompile limit of 2 (tests/test_compile_explainer.py has the diagnosis in full)."""
    from test_compile_explainer import first_step

    torch._dynamo.reset()
    try:
        with torch._dynamo.config.patch(recompile_limit=2, fail_on_recompile_limit_hit=True):
            first_step([1, 2, 3, 4])
    finally:
        torch._dynamo.reset()


CASES = {
    "torch-compile-recompile-limit": recompile_limit_at_step_0,
    "triton-no-active-driver": message(RuntimeError, "0 active drivers ([]). There should only be one."),
    "half-overflow-value": half_overflow,
    "half-op-on-cpu": message(RuntimeError, ADDMM_HALF),
    "flash-attention-unsupported": message(RuntimeError, FLASH_AMPERE),
    "softcap-unsupported-attention": softcap_with_sdpa,
    "token-ids-out-of-range": embedding_out_of_range,
    "trl-reward-count-mismatch": grpo_reward_count,
    "cuda-no-kernel-image": message(RuntimeError, NO_KERNEL),
}
# Signatures widened in this issue, with the new message they must recognise.
WIDENED = {
    "fp16-unscale-error": message(RuntimeError, UNSCALE_BF16),
    "bf16-unsupported": message(ValueError, VLLM_BF16),
    "token-ids-out-of-range": message(RuntimeError, DEVICE_ASSERT),
    "matmul-dtype-mismatch": mixed_dtype_model,
}
EXACT = [UNSCALE_BF16, ADDMM_HALF, VLLM_BF16, FLASH_AMPERE, FLASH_TRANSFORMERS, SRC_INDEX, DEVICE_ASSERT, NO_KERNEL,
         "value cannot be converted to type at::Half without overflow",
         "expected mat1 and mat2 to have the same dtype, but got: c10::Half != float",
         "element 0 of tensors does not require grad and does not have a grad_fn"]


def pasted_forms(text: str) -> list[str]:
    """The message as it arrives from a notebook, an issue tracker or a chat."""
    words = text.split(" ")
    wrapped = "\n".join(" ".join(words[i:i + 4]) for i in range(0, len(words), 4))
    return [
        text,
        wrapped,
        "  ".join(words),
        text.replace('"', "\u201c", 1).replace('"', "\u201d", 1).replace("'", "\u2019"),
        text.replace('"', "`").replace("'", "`"),
        "RuntimeError: " + text,
    ]


@pytest.mark.parametrize("signature", sorted(CASES))
def test_signature_recognises_its_case(signature):
    exc = raised(CASES[signature])
    d = diagnose(exc)
    assert d is not None and d.signature == signature, f"{type(exc).__name__}: {exc}"


@pytest.mark.parametrize("signature", sorted(WIDENED))
def test_widened_signature_recognises_the_new_message(signature):
    d = diagnose(raised(WIDENED[signature]))
    assert d is not None and d.signature == signature


@pytest.mark.parametrize("text", EXACT)
def test_exact_messages_match_in_every_pasted_form(text):
    expected = diagnose(RuntimeError(text)).signature
    for form in pasted_forms(text):
        d = diagnose(RuntimeError(form))
        assert d is not None and d.signature == expected, repr(form)


def test_normalised_form():
    assert normalised("value  cannot be\nconverted to type c10::Half") == "value cannot be converted to type half"
    assert normalised("\u201c_x\u201d not implemented for `Half`") == "'_x' not implemented for 'half'"


def test_every_new_signature_is_silent_on_every_other_case():
    from test_explain import REAL

    cases = {**{f"old:{k}": v for k, v in REAL.items()}, **CASES}
    errors = {name: raised(make) for name, make in cases.items()}
    errors["index_select"] = raised(lambda: torch.index_select(torch.ones(3), 0, torch.tensor([5])))
    errors["cuda-other-dtype"] = RuntimeError("\"addmm_cuda\" not implemented for 'Int'")
    errors["gpu-half"] = RuntimeError("\"baddbmm_cuda\" not implemented for 'Half'")
    for signature in CASES:
        for name, exc in errors.items():
            if name == signature:
                continue
            assert RULES[signature](exc) is None, f"{signature} fired on {name}: {exc}"


# ---- what each diagnosis says and offers ----------------------------------------------------------
def test_unscale_bf16_names_the_dtype_and_offers_the_upcast():
    d = diagnose(raised(WIDENED["fp16-unscale-error"]))
    assert d.evidence == {"grad_dtype": "bfloat16"} and d.fixes == ["upcast-trainable-fp32"]
    assert "bf16=True" in d.detail
    assert diagnose(raised(message(ValueError, "Attempting to unscale FP16 gradients."))).evidence == {
        "grad_dtype": "float16"}


def test_half_op_on_cpu_switches_to_fp32_and_names_the_op():
    d = diagnose(raised(CASES["half-op-on-cpu"]))
    assert d.evidence == {"op": "addmm_impl_cpu_"}
    assert d.fix_options == {"switch-precision": {"to": "fp32"}}


def test_vllm_bf16_message_reads_the_gpu():
    d = diagnose(raised(WIDENED["bf16-unsupported"]))
    assert d.evidence == {"gpu": "Tesla T4", "compute_capability": "7.5"}


def test_flash_and_softcap_choose_their_attention():
    flash = diagnose(raised(CASES["flash-attention-unsupported"]))
    assert flash.fix_options == {"set-attn-implementation": {"to": "sdpa"}}
    assert flash.evidence == {"min_compute_capability": "8.0"}
    hopper = diagnose(ImportError(FLASH_TRANSFORMERS))
    assert hopper.signature == "flash-attention-unsupported" and hopper.evidence == {"min_compute_capability": "9.0"}
    softcap = diagnose(raised(CASES["softcap-unsupported-attention"]))
    assert softcap.fix_options == {"set-attn-implementation": {"to": "eager"}}
    cell = softcap.fix_cells({"model": "gemma"})["set-attn-implementation"]["code"]
    assert 'gemma.set_attn_implementation("eager")' in cell


def test_embedding_index_error_reads_the_embedding_and_the_id():
    d = diagnose(raised(embedding_out_of_range))
    assert d.evidence == {"certain": True, "num_embeddings": TINY_VOCAB, "max_token_id": TINY_VOCAB + 1}
    assert d.fixes == ["resize-token-embeddings"]
    assert "len(tokenizer)" in d.fix_cells({"model": "m"})["resize-token-embeddings"]["code"]
    loose = diagnose(raised(WIDENED["token-ids-out-of-range"]))
    assert loose.evidence == {"certain": False} and "CUDA_LAUNCH_BLOCKING" in loose.detail
    assert diagnose(raised(message(RuntimeError, SRC_INDEX))).evidence == {"certain": True}


def test_dtype_mismatch_in_a_mixed_model_names_the_odd_module_not_a_precision_switch():
    d = diagnose(raised(mixed_dtype_model))
    assert d.evidence["cause"] == "mixed-dtypes" and d.evidence["layer"] == "lm_head"
    assert d.evidence["weight_dtype"] == "float32" and d.evidence["input_dtype"] == "bfloat16"
    assert d.evidence["minority_dtype_modules"] == {"float32": ["lm_head"]}
    assert "switch-precision" not in d.fixes


def test_a_cut_list_of_odd_modules_says_how_many_more_there_are():
    d = diagnose(raised(norms_and_head_in_float32_model))
    assert d.evidence["cause"] == "mixed-dtypes"
    assert d.evidence["minority_dtype_module_counts"] == {"float32": 10}  # 4 layers x 2 norms, the final norm, the head
    assert "lm_head" in d.evidence["minority_dtype_modules"]["float32"]
    assert "and 2 more" in d.detail  # eight named, the rest counted: the list no longer stops without a word


def test_dtype_mismatch_in_a_forced_fp32_model():
    d = diagnose(raised(forced_fp32_model))
    assert d.evidence["cause"] == "forced-fp32" and d.evidence["parameter_dtypes"].keys() == {"float32"}
    assert d.evidence["input_dtype"] == "bfloat16" and "switch-precision" not in d.fixes


def test_dtype_mismatch_from_a_4bit_compute_dtype():
    bnb = pytest.importorskip("bitsandbytes")
    model = torch.nn.Sequential(bnb.nn.Linear4bit(64, 64, compute_dtype=torch.float16), torch.nn.Linear(64, 8))
    model[0] = model[0].to("cpu")  # quantises the weight
    # A real Linear4bit computing in fp16 in front of a float32 head; the fp16 activations that reach the
    # head are in the 4-bit layers' compute dtype. (bitsandbytes 0.50 casts a 4-bit output back to its
    # input's dtype, so here they enter as fp16 inputs; the diagnosis reads dtypes, not their history.)
    x = torch.randn(2, 64, dtype=torch.float16)
    exc = raised(lambda: model(x))
    d = diagnose(exc)
    assert d is not None and d.signature == "matmul-dtype-mismatch", f"{type(exc).__name__}: {exc}"
    assert d.evidence["cause"] == "4bit-compute-dtype"
    assert d.evidence["linear4bit_compute_dtypes"] == {"float16": 1}
    assert "bnb_4bit_compute_dtype=float32" in d.detail


def test_dtype_mismatch_read_from_a_pasted_message():
    pasted = "RuntimeError: expected mat1 and mat2 to have the same\ndtype, but got: c10::Half != float"
    assert diagnose(RuntimeError(pasted)).evidence["dtypes"] == ["float16", "float32"]


def test_dtype_mismatch_without_a_traceback_says_so():
    d = diagnose(RuntimeError("expected mat1 and mat2 to have the same dtype, but got: float != c10::BFloat16"))
    assert d.evidence == {"dtypes": ["float32", "bfloat16"], "cause": "unknown"} and d.fixes == []


def test_every_new_fix_renders_with_the_users_names():
    for make in list(CASES.values()) + list(WIDENED.values()):
        d = diagnose(raised(make))
        for fix_id, cell in d.fix_cells({"model": "my_model"}).items():
            assert fix_id in fixes.available() and "my_model" in cell["code"]
