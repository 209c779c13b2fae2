"""nbguard.check_export on real PEFT adapters and Trainer runs (tiny Llama, CPU): the artifact reloaded as users
reload it against the model trained. Faithful saves and merges are quiet; each broken export is named."""
from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
from chat_helpers import chat_tokenizer
from notebook_helpers import run, shell  # noqa: F401 - the fixture

import nbguard
from nbguard.testing import TINY_VOCAB, TinyDataset, tiny_llama

pytestmark = pytest.mark.filterwarnings("ignore")
TARGETS = ["q_proj", "v_proj"]


def base_dir(tmp_path, vocab_from=None):
    path = tmp_path / "base"
    if not path.exists():
        tiny_llama().save_pretrained(path)
    return str(path)


def load_base(tmp_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(base_dir(tmp_path))


def train(model, tmp_path, steps: int = 4, lr: float = 1e-2, vocab: int = TINY_VOCAB):
    """A real Trainer run on the model (LoRA starts with lora_B = 0; a few steps move it)."""
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path / "run"), use_cpu=True, report_to=[], save_strategy="no",
                             per_device_train_batch_size=4, max_steps=steps, learning_rate=lr, disable_tqdm=True,
                             logging_steps=1)
    trainer = Trainer(model=model, args=args, train_dataset=TinyDataset(16, 16, vocab_size=vocab))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    return trainer


def lora(model, **options):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": TARGETS, **options}))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trained")
    model = lora(load_base(tmp))
    trainer = train(model, tmp)
    return tmp, model, trainer


def rules(result) -> set[str]:
    return {f.rule for f in result.findings}


# ---- quiet when faithful ------------------------------------------------------------------------
def test_a_faithful_adapter_with_its_tokenizer_is_quiet(trained, tmp_path):
    tmp, model, _ = trained
    tok = chat_tokenizer()
    model.save_pretrained(tmp_path / "adapter")
    tok.save_pretrained(tmp_path / "adapter")
    result = nbguard.check_export(model, str(tmp_path / "adapter"), tokenizer=tok)
    assert result.findings == []
    effect, artifact = result.comparisons["effect"], result.comparisons["artifact"]
    assert not effect.same and effect.max_logit_diff > 1e-3  # the training moved the adapter: a real comparison
    assert artifact.same and artifact.top1_agreement == 1.0
    assert result.comparisons["artifact_effect"].max_logit_diff == pytest.approx(effect.max_logit_diff, rel=1e-3)


def test_a_faithful_merge_is_quiet_as_object_and_as_folder(trained, tmp_path):
    _, model, _ = trained
    merged = copy.deepcopy(model).merge_and_unload()
    assert nbguard.check_export(model, merged).findings == []
    merged.save_pretrained(tmp_path / "merged")
    result = nbguard.check_export(model, str(tmp_path / "merged"))
    assert result.findings == [] and result.facts.kind == "merged"
    assert result.comparisons["artifact"].top1_agreement == 1.0


# ---- what differs, named ------------------------------------------------------------------------
def test_an_adapter_saved_before_training_is_named_zero_lora_b(tmp_path):
    model = lora(load_base(tmp_path))
    model.save_pretrained(tmp_path / "adapter")  # saved at the start (a callback, or the cell order)
    train(model, tmp_path)
    result = nbguard.check_export(model, str(tmp_path / "adapter"))
    assert rules(result) == {"export-adapter-no-effect"}
    f = result.finding("export-adapter-no-effect")
    assert "saved adapter" in f.title and "all zeros" in f.detail
    assert f.evidence["saved"]["zero_lora_B_count"] == f.evidence["saved"]["lora_B"] == 4
    assert f.fixes == ["resave-adapter"]
    # the fix writes the trained adapter: checked again, the folder is faithful
    nbguard.fixes.apply("resave-adapter", model=model, path=str(tmp_path / "adapter"))
    assert nbguard.check_export(model, str(tmp_path / "adapter")).findings == []


def test_an_adapter_never_trained_has_no_effect_and_says_why(tmp_path):
    model = lora(load_base(tmp_path))
    model.save_pretrained(tmp_path / "adapter")
    f = nbguard.check_export(model, str(tmp_path / "adapter")).finding("export-adapter-no-effect")
    assert f is not None and "trained adapter has no effect" in f.title and "lora_B" in f.detail


def test_a_zero_scaling_cancels_the_adapter(tmp_path):
    model = lora(load_base(tmp_path), lora_alpha=0, init_lora_weights=False)
    model.save_pretrained(tmp_path / "adapter")
    f = nbguard.check_export(model, str(tmp_path / "adapter")).finding("export-adapter-no-effect")
    assert f is not None and "scaling is 0" in f.detail and "lora_alpha=0" in f.detail


def test_weights_trained_outside_the_adapter_are_named_with_modules_to_save(tmp_path):
    model = lora(load_base(tmp_path))
    model.base_model.model.model.norm.weight.requires_grad_(True)  # trained by hand, not via modules_to_save
    train(model, tmp_path)
    model.save_pretrained(tmp_path / "adapter")
    result = nbguard.check_export(model, str(tmp_path / "adapter"))
    assert rules(result) == {"export-trained-modules-not-saved"}
    f = result.finding("export-trained-modules-not-saved")
    assert "model.norm" in f.title and "modules_to_save=['norm']" in f.detail
    assert not result.comparisons["artifact"].same


def test_modules_to_save_keeps_them_and_is_quiet(tmp_path):
    model = lora(load_base(tmp_path), modules_to_save=["norm"])
    train(model, tmp_path)
    model.save_pretrained(tmp_path / "adapter")
    assert nbguard.check_export(model, str(tmp_path / "adapter")).findings == []


def _resized(tmp_path):
    """The base grown by 8 new tokens (the tokenizer's added tokens), LoRA on q/v, trained."""
    tok = chat_tokenizer()
    tok.add_tokens([f"<new{i}>" for i in range(8)])
    base = load_base(tmp_path)
    base.resize_token_embeddings(len(tok))
    model = lora(base)
    train(model, tmp_path)
    return model, tok


def test_resized_embeddings_not_saved_are_named(tmp_path):
    model, tok = _resized(tmp_path)
    path = tmp_path / "adapter"
    model.save_pretrained(path, save_embedding_layers=False)  # "auto" cannot tell offline, or set by hand
    tok.save_pretrained(path)
    result = nbguard.check_export(model, str(path), tokenizer=tok)
    assert rules(result) == {"export-embeddings-not-saved"}
    f = result.finding("export-embeddings-not-saved")
    assert f"resized from {TINY_VOCAB} to {TINY_VOCAB + 8}" in f.title
    assert f.fixes == ["save-embedding-layers"]
    assert any("embed_tokens" in name for name in f.evidence["differing"])
    assert "save_embedding_layers=True" in result.to_document()["fix_cells"]["save-embedding-layers"]["code"]
    nbguard.fixes.apply("save-embedding-layers", model=model, path=str(path))
    assert nbguard.check_export(model, str(path), tokenizer=tok).findings == []


def test_resized_embeddings_saved_without_the_tokenizer_cannot_reload(tmp_path):
    model, tok = _resized(tmp_path)
    model.save_pretrained(tmp_path / "adapter", save_embedding_layers=True)
    result = nbguard.check_export(model, str(tmp_path / "adapter"), tokenizer=tok)
    assert {"export-reload-fails", "export-tokenizer-not-saved"} <= rules(result)
    assert "save the tokenizer" in result.finding("export-reload-fails").detail


def test_a_merge_into_bf16_weights_is_named(trained):
    _, model, _ = trained
    merged = copy.deepcopy(model).to(torch.bfloat16).merge_and_unload()  # the base in bf16, as often loaded
    f = nbguard.check_export(model, merged).finding("export-merge-differs")
    assert f is not None and "bfloat16" in f.detail and f.fixes == ["merge-in-fp32"]
    assert f.evidence["share_of_adapter_effect"] > 0


# ---- the tokenizer and chat template beside the model --------------------------------------------
def test_a_tokenizer_not_saved_is_flagged(trained, tmp_path):
    _, model, _ = trained
    model.save_pretrained(tmp_path / "adapter")
    result = nbguard.check_export(model, str(tmp_path / "adapter"), tokenizer=chat_tokenizer())
    assert rules(result) == {"export-tokenizer-not-saved"}
    assert "tokenizer.save_pretrained" in result.to_document()["fix_cells"]["save-tokenizer"]["code"]


def test_a_tokenizer_saved_without_its_chat_template_is_flagged(trained, tmp_path):
    _, model, _ = trained
    tok = chat_tokenizer()
    model.save_pretrained(tmp_path / "adapter")
    saved = copy.deepcopy(tok)
    saved.chat_template = None
    saved.save_pretrained(tmp_path / "adapter")
    f = nbguard.check_export(model, str(tmp_path / "adapter"), tokenizer=tok).finding("export-chat-template-not-saved")
    assert f is not None and "without a chat template" in f.title


def test_a_different_saved_template_names_its_first_differing_token(trained, tmp_path):
    _, model, _ = trained
    tok = chat_tokenizer()
    model.save_pretrained(tmp_path / "adapter")
    saved = copy.deepcopy(tok)
    saved.chat_template = tok.chat_template.replace("<|assistant|> {% generation %}", "<|assistant|> <think> {% generation %}")
    saved.save_pretrained(tmp_path / "adapter")
    f = nbguard.check_export(model, str(tmp_path / "adapter"), tokenizer=tok).finding("export-chat-template-not-saved")
    assert f is not None and "'<think>'" in f.title
    diff = f.evidence["tokenizer"]["template_difference"]
    assert diff["served"] == "<think>" and diff["before"][-1] == "<|assistant|>"


# ---- display, report, bad input -----------------------------------------------------------------
def test_the_result_displays_and_joins_the_report(trained, tmp_path):
    _, model, _ = trained
    model.save_pretrained(tmp_path / "adapter")
    result = nbguard.check_export(model, str(tmp_path / "adapter"), tokenizer=chat_tokenizer())
    text = str(result)
    assert "nbguard export check" in text and "export-tokenizer-not-saved" in text and "top-1 agreement" in text
    bundle = result._repr_mimebundle_()
    assert {"text/plain", "text/html", "application/vnd.nbguard.v1+json"} <= set(bundle)
    assert "export-tokenizer-not-saved" in bundle["text/html"]
    json.dumps(result.to_dict())
    report = nbguard.report()
    assert "export-tokenizer-not-saved" in str(report)


def test_bad_input_says_what_was_wrong(trained, tmp_path):
    _, model, _ = trained
    with pytest.raises(ValueError, match="does not exist"):
        nbguard.check_export(model, str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match="neither an adapter folder.*notes.txt"):
        nbguard.check_export(model, str(tmp_path / "empty"))
    with pytest.raises(TypeError, match="exported must be a folder"):
        nbguard.check_export(model, 3)
    with pytest.raises(TypeError, match="trained model"):
        nbguard.check_export("model", str(tmp_path))
    with pytest.raises(ValueError, match="the trained model itself"):
        nbguard.check_export(model, model)
    merged_in_place = lora(tiny_llama(), init_lora_weights=False)
    merged_in_place.merge_and_unload()
    with pytest.raises(ValueError, match="merged the adapter into it in place"):
        nbguard.check_export(merged_in_place, str(tmp_path))


def test_an_adapter_whose_base_is_not_local_asks_for_base(tmp_path):
    model = lora(tiny_llama())  # built from a config: no base_model_name_or_path to reload from
    model.save_pretrained(tmp_path / "adapter")
    with pytest.raises(ValueError, match="pass base="):
        nbguard.check_export(model, str(tmp_path / "adapter"))


# ---- the magic --------------------------------------------------------------------------------
def test_nbguard_export_check_magic_names_the_zero_adapter_and_refuses_bad_input(shell, tmp_path):  # noqa: F811
    """%nbguard export-check MODEL PATH in a real InteractiveShell: the same finding as the API, shown under
    the cell; a path that is neither a folder nor a variable, or a non-model, is one usage line."""
    model = lora(load_base(tmp_path))
    model.save_pretrained(tmp_path / "adapter")  # saved before training: lora_B all zeros in the file
    train(model, tmp_path)
    shell.user_ns.update(model=model, n=3)
    cell = run(shell, f"%nbguard export-check model {tmp_path / 'adapter'}")
    assert cell.error is None, cell.stdout
    [doc] = cell.docs  # the result's own document, shown under the cell
    assert [f["rule"] for f in doc["findings"]] == ["export-adapter-no-effect"]
    missing = run(shell, f"%nbguard export-check model {tmp_path / 'nowhere'}")
    assert "is neither a folder nor a variable of this notebook" in missing.stdout + missing.stderr
    wrong = run(shell, f"%nbguard export-check n {tmp_path / 'adapter'}")
    assert "export-check takes the trained model or its Trainer" in wrong.stdout + wrong.stderr
    alone = run(shell, "%nbguard export-check model")
    assert "%nbguard export-check MODEL EXPORTED" in alone.stdout + alone.stderr


def test_merge_in_fp32_applied_and_its_cell_run_both_give_the_merge_the_check_finds_faithful(trained, tmp_path, shell):  # noqa: F811
    """The fix the bf16 merge is offered: applied through nbguard.fixes.apply, and its cell run in a real
    shell as the user runs it; each merged model reloads equal to the model trained."""
    tmp, model, _ = trained
    bad = copy.deepcopy(model).to(torch.bfloat16).merge_and_unload()
    assert nbguard.check_export(model, bad).finding("export-merge-differs") is not None  # the problem it fixes
    applied = tmp_path / "applied"
    changes = nbguard.fixes.apply("merge-in-fp32", model=model, path=str(applied), base=base_dir(tmp))
    assert changes.changed == {"saved": str(applied), "merged_in": "float32", "saved_as": "float32"}
    assert rules(nbguard.check_export(model, str(applied))) == set()
    celled = tmp_path / "from_cell"
    shell.user_ns["model"] = model
    cell = run(shell, nbguard.fixes.code("merge-in-fp32", model="model", path=str(celled), base=base_dir(tmp)))
    assert cell.result.error_in_exec is None, cell.result.error_in_exec
    assert rules(nbguard.check_export(model, str(celled))) == set()


def test_a_float32_merge_of_an_adapter_trained_on_a_bf16_base_is_quiet_and_the_bf16_merge_is_not(tmp_path):
    """The merge is judged on the weights: the float32 merge computes in another precision than the bf16 model
    trained (its logits differ by that alone, top-1 below 100%), yet carries the whole update; the bf16 merge
    rounds part of it away."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir(tmp_path), dtype=torch.bfloat16)
    model = lora(base)  # PEFT keeps the adapters in float32 (autocast_adapter_dtype)
    train(model, tmp_path, lr=1e-3)  # a small update, as real fine-tunes make: bf16 rounding takes ~7% of it
    fp32 = nbguard.check_export(model, copy.deepcopy(model).to(torch.float32).merge_and_unload())
    assert fp32.findings == []
    assert fp32.facts.merge["lost_share"] < 1e-6 and fp32.facts.merge["layers"] == 2 * len(TARGETS)
    assert not fp32.facts.comparisons["artifact"].same  # the logits alone would have called it a bad merge
    f = nbguard.check_export(model, copy.deepcopy(model).merge_and_unload()).finding("export-merge-differs")
    assert f is not None and 0.05 < f.evidence["merge"]["lost_share"] < 0.1 and "bfloat16" in f.detail  # ~7%
    assert f.fixes == ["merge-in-fp32"] and "serve it in float32" in f.detail


def test_a_merge_into_tied_embeddings_is_named_and_offers_no_merge_fix(tmp_path):
    """LoRA on lm_head of a model whose lm_head is tied to the input embeddings: merging writes the update into
    the shared weight, so the embeddings change too; float32 all along, so only the tie explains it."""
    model = lora(tiny_llama(tie_word_embeddings=True), target_modules=["q_proj", "lm_head"])
    train(model, tmp_path)
    merged = copy.deepcopy(model).merge_and_unload()
    f = nbguard.check_export(model, merged).finding("export-merge-differs")
    assert f is not None
    assert f.evidence["merge"]["shared_weight"] and "bfloat16" not in f.detail and "tie" in f.detail
    assert f.fixes == [] and "serve the base with the adapter unmerged" in f.detail
