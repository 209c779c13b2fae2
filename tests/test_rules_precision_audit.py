"""Issue 13 items 6-11, 13 and 15: precision and configuration rules, each with the real mechanism where CPU has it."""
from __future__ import annotations

import pytest
import torch
from audit_helpers import make_args, make_trainer
from packaging.version import Version

import nbguard
from nbguard import fixes
from nbguard.auditor.rules.attention import sdpa_raises_on_softcap
from nbguard.environment import in_release_series
from nbguard.findings import Severity
from nbguard.testing import TINY_VOCAB, _tiny_common, tiny_batch, tiny_llama


def audit(*a, **kw):
    kw.setdefault("hardware", "a100")
    return nbguard.audit(*a, **kw)


# ---- 6. fp16-unscale-error widened to bf16 trainable weights ------------------------------------
def test_bf16_trainable_weights_under_fp16_flagged_on_a_gpu(tmp_path):
    model = tiny_llama(dtype=torch.bfloat16)
    f = audit(model, args=make_args(tmp_path, fp16=True), hardware="a100").finding("fp16-unscale-error")
    assert f is not None and f.severity == Severity.ERROR
    assert f.evidence["dtypes"] == ["bfloat16"] and f.fixes == ["upcast-trainable-fp32"]
    assert "_amp_foreach_non_finite_check_and_unscale_cuda" in f.detail
    # After the fix the rule is silent: every trainable weight is float32.
    fixes.apply("upcast-trainable-fp32", model=model)
    assert "fp16-unscale-error" not in audit(model, args=make_args(tmp_path, fp16=True), hardware="a100")


def test_bf16_trainable_weights_not_flagged_where_the_scaler_takes_them(tmp_path):
    model = tiny_llama(dtype=torch.bfloat16)
    # CPU: the real GradScaler("cpu") unscales bf16 gradients without complaint, so nothing to predict.
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model(**tiny_batch(1, 8)).loss.float()).backward()
    scaler.unscale_(opt)
    assert "fp16-unscale-error" not in audit(model, args=make_args(tmp_path, fp16=True), hardware="cpu")
    # bf16 mixed precision: no GradScaler at all.
    assert "fp16-unscale-error" not in audit(model, args=make_args(tmp_path, bf16=True), hardware="a100")


def test_fp16_trainable_weights_still_flagged_with_both_dtypes_listed(tmp_path):
    model = tiny_llama(dtype=torch.bfloat16)
    model.model.layers[0].to(torch.float16)
    f = audit(model, args=make_args(tmp_path, fp16=True), hardware="t4").finding("fp16-unscale-error")
    assert f.evidence["dtypes"] == ["bfloat16", "float16"]
    assert "Attempting to unscale FP16 gradients" in f.detail


# ---- 7. fp16 for a checkpoint saved in bf16 -------------------------------------------------------
def _saved(tmp_path, dtype):
    path = tmp_path / f"ckpt-{dtype}".replace("torch.", "")
    tiny_llama(dtype=dtype).save_pretrained(path)
    return path


def test_fp16_for_a_bf16_checkpoint_read_from_its_saved_config(tmp_path):
    from transformers import AutoModelForCausalLM

    path = _saved(tmp_path, torch.bfloat16)
    # Loading in fp16 rewrites model.config.dtype: only the saved config.json still says bf16.
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float16)
    assert model.config.dtype == torch.float16
    f = audit(model, args=make_args(tmp_path, fp16=True), hardware="t4").finding("fp16-overflow-risk")
    assert f is not None and f.severity == Severity.WARNING
    assert f.evidence["checkpoint_dtype"] == "bfloat16"
    assert f.evidence["checkpoint_dtype_from"] == str(path / "config.json")
    assert "model_type" not in f.evidence  # llama is not in the family list: the checkpoint said it
    # Loaded as saved (bf16), then trained with fp16=True: the in-memory config says it.
    model = AutoModelForCausalLM.from_pretrained(path)
    f = audit(model, args=make_args(tmp_path, fp16=True), hardware="t4").finding("fp16-overflow-risk")
    assert f.evidence["checkpoint_dtype_from"] == str(path / "config.json")


def test_checkpoint_dtype_from_config_when_no_file(tmp_path):
    model = tiny_llama()
    model.config.dtype = torch.bfloat16  # what AutoConfig of a bf16 checkpoint holds
    f = audit(model, args=make_args(tmp_path, fp16=True), hardware="t4").finding("fp16-overflow-risk")
    assert f.evidence["checkpoint_dtype_from"] == "model.config.dtype"


def test_no_checkpoint_finding_for_fp32_or_fp16_checkpoints_nor_bf16_training(tmp_path):
    from transformers import AutoModelForCausalLM

    for dtype in (torch.float32, torch.float16):
        model = AutoModelForCausalLM.from_pretrained(_saved(tmp_path, dtype))
        assert "fp16-overflow-risk" not in audit(model, args=make_args(tmp_path, fp16=True), hardware="t4")
    bf16 = AutoModelForCausalLM.from_pretrained(_saved(tmp_path, torch.bfloat16))
    assert "fp16-overflow-risk" not in audit(bf16, args=make_args(tmp_path, bf16=True), hardware="a100")


# ---- 8. FlashAttention on a GPU without it (configuration: flash-attn needs CUDA) ---------------
def flash_model():
    model = tiny_llama()
    # What from_pretrained(attn_implementation="flash_attention_2") leaves on the config (flash-attn
    # is CUDA-only, so it cannot be installed here; the setter records the choice like the loader does).
    model.config._attn_implementation = "flash_attention_2"
    return model


def test_flash_attention_on_a_t4_and_on_a_cpu():
    f = audit(flash_model(), hardware="t4").finding("flash-attention-unsupported")
    assert f.evidence["compute_capability"] == "7.5" and f.evidence["min_compute_capability"] == "8.0"
    assert f.fixes == ["set-attn-implementation"]
    assert "flash-attention-unsupported" in audit(flash_model(), hardware="v100")
    assert audit(flash_model(), hardware="cpu").finding("flash-attention-unsupported").evidence[
        "compute_capability"] is None


def test_flash_attention_fine_on_ampere_and_sdpa_fine_everywhere():
    assert "flash-attention-unsupported" not in audit(flash_model(), hardware="a100")
    assert "flash-attention-unsupported" not in audit(flash_model(), hardware="l4")
    assert "flash-attention-unsupported" not in audit(tiny_llama(), hardware="t4")


def test_set_attn_implementation_fix_moves_flash_to_sdpa_and_the_model_runs():
    model = flash_model()
    result = fixes.apply("set-attn-implementation", model=model)
    assert result.changed == {"config._attn_implementation": "flash_attention_2 -> sdpa"}
    assert "flash-attention-unsupported" not in audit(model, hardware="t4")
    assert torch.isfinite(model(**tiny_batch()).loss)
    assert not fixes.apply("set-attn-implementation", model=model).changed  # idempotent


# ---- 9. Gemma 2 softcapping with sdpa ------------------------------------------------------------
def tiny_gemma2(attn: str):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    model = Gemma2ForCausalLM(Gemma2Config(**_tiny_common({"head_dim": 16, "sliding_window": 16})))
    model.config._attn_implementation = attn  # set_attn_implementation("sdpa") is refused for Gemma 2 today
    return model


def test_softcapping_with_sdpa_flagged_and_the_real_forward_fails():
    model = tiny_gemma2("sdpa")
    f = audit(model).finding("softcap-unsupported-attention")
    assert f.evidence["attn_logit_softcapping"] == 50.0 and f.evidence["config._attn_implementation"] == "sdpa"
    assert f.evidence["sdpa_raises"] is sdpa_raises_on_softcap()
    if sdpa_raises_on_softcap():  # current transformers refuses it
        assert "refuses it" in f.detail
        with pytest.raises(ValueError, match="does not support `softcap`"):
            model(**tiny_batch())
    else:  # older transformers (the Colab lane's 5.9) silently leaves the scores uncapped
        assert "silently ignored" in f.detail
        for layer in model.model.layers:  # a cap tight enough to matter for tiny scores
            layer.self_attn.attn_logit_softcapping = 0.1
        with torch.no_grad():
            uncapped = model(**tiny_batch()).logits
            model.config._attn_implementation = "eager"
            capped = model(**tiny_batch()).logits
            model.config._attn_implementation = "sdpa"
        assert not torch.allclose(uncapped, capped, atol=1e-4)  # sdpa computed another model
    fixes.apply("set-attn-implementation", model=model)  # softcapped: eager
    assert model.config._attn_implementation == "eager"
    assert torch.isfinite(model(**tiny_batch()).loss)
    assert "softcap-unsupported-attention" not in audit(model)


def test_softcapping_not_flagged_with_eager_nor_without_softcapping():
    assert "softcap-unsupported-attention" not in audit(tiny_gemma2("eager"))
    llama = tiny_llama()  # sdpa, no softcapping
    assert llama.config._attn_implementation == "sdpa"
    assert "softcap-unsupported-attention" not in audit(llama)


# ---- 10. tied embeddings adapted on one side only -------------------------------------------------
def tied_peft(**lora):
    from peft import LoraConfig, get_peft_model

    model = tiny_llama(tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, **lora))


def test_lora_on_the_input_side_of_tied_embeddings_changes_the_model_on_merge():
    model = tied_peft(target_modules=["embed_tokens", "q_proj"], init_lora_weights=False)
    f = audit(model).finding("tied-embeddings-one-side")
    assert f.evidence["adapted"] == {"input (get_input_embeddings)": "lora"}
    # The mechanism: the trained model uses the adapter on the input side only; merging writes it into
    # the shared matrix, so the output head changes too and the merged model computes something else.
    batch = tiny_batch(1, 8)
    model.eval()
    with torch.no_grad():
        trained = model(**batch).logits
        merged = model.merge_and_unload()(**batch).logits
    assert not torch.allclose(trained, merged, atol=1e-4)


def test_untie_embeddings_fix_makes_the_merged_model_the_trained_one():
    model = tied_peft(target_modules=["embed_tokens", "q_proj"], init_lora_weights=False)
    result = fixes.apply("untie-embeddings", model=model)
    assert result.changed == {"base_model.model.lm_head.weight": "own copy of the input embeddings",
                              "config.tie_word_embeddings": "True -> False"}
    assert "tied-embeddings-one-side" not in audit(model)
    batch = tiny_batch(1, 8)
    model.eval()
    with torch.no_grad():
        trained = model(**batch).logits
        merged = model.merge_and_unload()(**batch).logits
    torch.testing.assert_close(trained, merged, atol=1e-5, rtol=1e-5)


def test_untie_embeddings_cell_does_the_same():
    model = tied_peft(target_modules=["embed_tokens"], init_lora_weights=False)
    exec(compile(fixes.code("untie-embeddings", model="peft_model"), "<cell>", "exec"), {"peft_model": model})  # noqa: S102
    base = model.get_base_model()
    assert base.lm_head.weight is not base.model.embed_tokens.base_layer.weight
    assert torch.equal(base.lm_head.weight, base.model.embed_tokens.base_layer.weight)
    assert "tied-embeddings-one-side" not in audit(model)
    assert not fixes.apply("untie-embeddings", model=model).changed  # idempotent


def test_modules_to_save_on_the_head_of_tied_embeddings():
    f = audit(tied_peft(target_modules=["q_proj"], modules_to_save=["lm_head"])).finding("tied-embeddings-one-side")
    assert f.evidence["adapted"] == {"output (get_output_embeddings)": "modules_to_save"}


def test_tied_embeddings_not_flagged_when_tying_is_kept_or_nothing_touches_them():
    assert "tied-embeddings-one-side" not in audit(tied_peft(target_modules=["q_proj", "v_proj"]))
    kept = tied_peft(target_modules=["embed_tokens"], ensure_weight_tying=True)
    assert "tied-embeddings-one-side" not in audit(kept)
    from peft import LoraConfig, get_peft_model

    untied = get_peft_model(tiny_llama(), LoraConfig(r=4, target_modules=["embed_tokens"]))
    assert "tied-embeddings-one-side" not in audit(untied)


# ---- 11. tokens added without resize_token_embeddings ---------------------------------------------
def tiny_tokenizer(extra: int = 0):
    """A real fast tokenizer over the tiny vocabulary, built in memory (no hub)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, **{f"w{i}": i for i in range(1, TINY_VOCAB)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>")
    if extra:
        tok.add_tokens([f"<new{i}>" for i in range(extra)])
    return tok


def test_added_tokens_without_resize_flagged_and_the_real_index_error(tmp_path):
    from transformers import Trainer

    tok = tiny_tokenizer(extra=2)
    model = tiny_llama()
    ids = torch.tensor([tok("w5 w6 <new1>")["input_ids"]])
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    trainer = Trainer(model=model, args=make_args(tmp_path), processing_class=tok,
                      train_dataset=make_trainer(model, make_args(tmp_path)).train_dataset)
    f = audit(trainer=trainer, batch=batch).finding("token-ids-out-of-range")
    assert f.evidence["embedding_rows"] == TINY_VOCAB and f.evidence["tokenizer_size"] == TINY_VOCAB + 2
    assert f.evidence["input_ids_out_of_range"] == {"first": [TINY_VOCAB + 1], "count": 1}
    with pytest.raises(IndexError, match="index out of range in self"):
        model(**batch)
    result = fixes.apply("resize-token-embeddings", trainer=trainer)
    assert result.changed == {"embedding_rows": f"{TINY_VOCAB} -> {TINY_VOCAB + 2}"}
    assert "len(trainer.processing_class)" in result.code
    assert torch.isfinite(model(**batch).loss)
    # mean_resizing: the new rows are not zero, so zero-embedding-rows has nothing to say either.
    after = audit(trainer=trainer, batch=batch)
    assert "token-ids-out-of-range" not in after and "zero-embedding-rows" not in after


def test_added_tokens_found_in_batches_sampled_from_the_trainer(tmp_path):
    from transformers import Trainer

    tok = tiny_tokenizer(extra=2)
    ids = torch.tensor(tok(["w1 w2 w3 <new0>", "w4 w5 w6 w7"])["input_ids"])
    rows = [{"input_ids": r, "attention_mask": torch.ones_like(r), "labels": r.clone()} for r in ids] * 4
    trainer = Trainer(model=tiny_llama(), args=make_args(tmp_path, max_steps=1), train_dataset=rows)
    # No tokenizer on the trainer and no batch= : only the sampled batches show it.
    f = audit(trainer=trainer).finding("token-ids-out-of-range")
    assert f.evidence["input_ids_out_of_range"] == {"first": [TINY_VOCAB], "count": 1}
    assert f.evidence["batch_source"] == "trainer" and "tokenizer_size" not in f.evidence
    with pytest.raises(IndexError, match="index out of range in self"):
        trainer.train()


def test_in_range_ids_and_a_resized_model_are_fine():
    model = tiny_llama()
    assert "token-ids-out-of-range" not in audit(model, batch=tiny_batch())
    model.resize_token_embeddings(TINY_VOCAB + 2)
    batch = tiny_batch()
    batch["input_ids"][0, 0] = TINY_VOCAB + 1
    assert "token-ids-out-of-range" not in audit(model, batch=batch)


def test_resize_fix_cell_runs_and_needs_a_size():
    model = tiny_llama()
    code = fixes.code("resize-token-embeddings", model="m", tokenizer="tok")
    scope = {"m": model, "tok": tiny_tokenizer(extra=3)}
    exec(compile(code, "<cell>", "exec"), scope)  # noqa: S102 - the cell nbguard hands the user
    assert model.get_input_embeddings().weight.shape[0] == TINY_VOCAB + 3
    with pytest.raises(ValueError, match="num_tokens=len"):
        fixes.apply("resize-token-embeddings", model=tiny_llama())


# ---- 13. the cache-eval-crash gate takes pre-releases ---------------------------------------------
@pytest.mark.parametrize("version, inside", [
    ("4.50.0.dev0", True), ("4.50.0rc1", True), ("4.50.0", True), ("4.50.3", True),
    ("4.49.0", False), ("4.51.0.dev0", False), ("4.51.0", False), ("5.0.0", False),
])
def test_cache_eval_crash_release_gate(version, inside):
    from nbguard.auditor.rules.cache import CACHE_DTYPE_RELEASES

    assert in_release_series(Version(version), *CACHE_DTYPE_RELEASES) is inside
    assert in_release_series(None, *CACHE_DTYPE_RELEASES) is False


# ---- 15. wording against today's libraries ---------------------------------------------------------
def test_bf16_on_a_t4_wording_matches_current_transformers():
    import inspect

    from transformers.utils import import_utils

    f = audit(tiny_llama(dtype=torch.bfloat16), hardware="t4").finding("bf16-unsupported")
    assert "refuses bf16=True" not in f.detail and "accepts bf16=True" in f.detail
    # Why: TrainingArguments' bf16 check asks is_torch_bf16_gpu_available(), which on CUDA is
    # torch.cuda.is_bf16_supported() with its default including_emulation=True: True on a T4.
    source = inspect.getsource(import_utils.is_torch_bf16_gpu_available)
    assert "return torch.cuda.is_bf16_supported()" in source
    assert inspect.signature(torch.cuda.is_bf16_supported).parameters["including_emulation"].default is True


def test_fully_masked_rows_wording_matches_current_torch():
    batch = tiny_batch(2, 8, pad_rows=1)
    f = audit(tiny_llama(), batch=batch).finding("fully-masked-rows")
    assert "zeros in sdpa" in f.detail and "older PyTorch" in f.detail
    # What the wording says: today the padding-only row stays finite under sdpa and eager, in fp32 and fp16.
    for impl in ("sdpa", "eager"):
        for dtype in (torch.float32, torch.float16):
            model = tiny_llama(dtype=dtype)
            model.config._attn_implementation = impl
            with torch.no_grad():
                assert torch.isfinite(model(**batch).logits[1]).all(), (impl, dtype)


def test_checkpoint_dtype_read_from_the_local_hub_cache(tmp_path, monkeypatch):
    """A model loaded by hub id: its config.json is found in the hub cache, without any network."""
    import json

    from nbguard.auditor.checkpoint import checkpoint_dtype

    cache = tmp_path / "hub"
    snapshot = cache / "models--someorg--tiny-bf16" / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("0123abcd")
    tiny_llama(dtype=torch.bfloat16).save_pretrained(snapshot)  # config.json says dtype: bfloat16
    assert json.loads((snapshot / "config.json").read_text())["dtype"] == "bfloat16"
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))
    model = tiny_llama(dtype=torch.float16)
    model.config._name_or_path = "someorg/tiny-bf16"
    model.config.dtype = torch.float16  # what from_pretrained(..., dtype=torch.float16) leaves
    assert checkpoint_dtype(model.config) == ("bfloat16", str(snapshot / "config.json"))
    model.config._name_or_path = "someorg/not-cached"
    assert checkpoint_dtype(model.config) == ("float16", "model.config.dtype")
