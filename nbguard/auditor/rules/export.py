"""The export rules: they judge what ``nbguard.check_export`` measured (``ctx.export``, an ExportFacts).

A plain audit has no exported artifact, so these rules say nothing there. Each names what differs
between the model trained and the artifact as users load it: an adapter with no effect, a merge that
lost the adapter, weights trained but not saved, embeddings resized but not saved, ties broken, the
tokenizer or its chat template left behind.
"""
from __future__ import annotations

from typing import Any

from ..export import LOST_SHARE, ExportFacts
from ..registry import capped, finding, rule

FAITHFUL_MERGE = 0.01  # share of the adapter's weight update a merge may lose (float32 rounding loses ~1e-7)


def _facts(ctx: Any) -> ExportFacts | None:
    facts = getattr(ctx, "export", None)
    return facts if isinstance(facts, ExportFacts) else None


def _compared(ctx: Any) -> ExportFacts | None:
    """The facts, when the artifact was loaded back and compared."""
    facts = _facts(ctx)
    return facts if facts is not None and "artifact" in facts.comparisons else None


def _numbers(facts: ExportFacts) -> dict:
    return {k: c.to_dict() for k, c in facts.comparisons.items()}


def _not_saved(facts: ExportFacts) -> tuple[dict, dict]:
    """(embedding parameters, other non-LoRA parameters) that differ between trained and reloaded."""
    emb: dict[str, dict] = {}
    other: dict[str, dict] = {}
    for name, how in facts.differing.items():
        if "lora_" in name:
            continue
        (emb if name in facts.embedding_params else other)[name] = how
    return emb, other


def _vocab_changed(facts: ExportFacts) -> bool:
    c = facts.comparisons.get("artifact")
    return c is not None and c.vocab[0] != c.vocab[1]


def _saved_adapter_dead(facts: ExportFacts) -> bool:
    effect, saved = facts.comparisons.get("effect"), facts.comparisons.get("artifact_effect")
    return effect is not None and saved is not None and not effect.same and saved.same


def _trained_dead(facts: ExportFacts) -> bool:
    effect = facts.comparisons.get("effect")
    return effect is not None and effect.same


def _ties_broken(facts: ExportFacts) -> bool:
    a, b = facts.ties.get("trained"), facts.ties.get("reloaded")
    return a is not None and b is not None and a != b


def _explained(facts: ExportFacts) -> bool:
    """Another export rule names what differs."""
    emb, other = _not_saved(facts)
    return (_trained_dead(facts) or _saved_adapter_dead(facts) or bool(emb) or bool(other) or _vocab_changed(facts)
            or _ties_broken(facts) or (facts.kind != "adapter" and facts.trained_is_peft))


@rule("export-reload-fails", "error")
def export_reload_fails(ctx):
    """The exported folder cannot be loaded back the way users load it (base + adapter, or the merged model)."""
    facts = _facts(ctx)
    if facts is None or "error" not in facts.load:
        return None
    error = facts.load["error"]
    hint = ""
    if "size mismatch" in error and ("embed" in error or "lm_head" in error):
        hint = (" The saved embeddings have another vocabulary size than the base: save the tokenizer beside the "
                "adapter (AutoPeftModelForCausalLM resizes the base to its length), or resize the base before loading.")
    return finding("export-reload-fails", f"{facts.path} cannot be loaded back",
                   f"Loading it as users do raised {error.splitlines()[0][:300]}.{hint}",
                   {"error": error[:2000], "kind": facts.kind, "tokenizer": facts.tokenizer},
                   fixes=["save-tokenizer"] if hint else [])


@rule("export-adapter-no-effect", "error")
def export_adapter_no_effect(ctx):
    """The trained adapter, or the adapter as saved and reloaded, changes no logit: zero lora_B, LoRA on no module, a scaling of 0."""
    facts = _compared(ctx)
    if facts is None or not facts.trained_is_peft:
        return None
    evidence = {"comparisons": _numbers(facts), "lora": facts.lora}
    if _trained_dead(facts):
        lora = facts.lora
        if not lora.get("layers"):
            why = (f"the adapter has no LoRA layers: target_modules {lora.get('target_modules')} matched no module of "
                   "this model")
        elif lora.get("zero_scaling"):
            why = (f"the LoRA scaling is 0 (lora_alpha={lora.get('lora_alpha')}, r={lora.get('r')}): lora_alpha / r "
                   "multiplies every update by zero")
        elif lora.get("zero_lora_B_count") == lora.get("layers"):
            why = ("every lora_B matrix is still all zeros, as PEFT initialises it: the adapter was never trained "
                   "(training did not run, the optimizer was built before get_peft_model and holds other parameters, "
                   "or the learning rate is 0)")
        else:
            why = "its update cancels out on these probes"
        return finding("export-adapter-no-effect", "the trained adapter has no effect on the logits",
                       f"With the adapter and with `with model.disable_adapter():` the model gives the same logits on "
                       f"the probe batches: {why}. Whatever you export from it is the base model.", evidence)
    if facts.kind == "adapter" and _saved_adapter_dead(facts):
        saved = facts.saved
        if saved.get("lora_B") and saved.get("zero_lora_B_count") == saved.get("lora_B"):
            why = (f"every lora_B in {saved.get('file')} is all zeros ({saved['lora_B']} tensors): the file was written "
                   "before training, or from a fresh get_peft_model copy, not from the model you trained")
            fixes = ["resave-adapter"]
        elif not saved.get("lora_B"):
            why = f"{saved.get('file') or 'the folder'} holds no lora_B tensor at all"
            fixes = ["resave-adapter"]
        elif saved.get("all_zero_count") or saved.get("empty_count"):  # export-empty-tensors names them
            why = (f"{saved.get('all_zero_count') or saved.get('empty_count')} saved tensors are all zeros or empty "
                   f"({', '.join(saved.get('all_zero') or saved.get('empty') or [])}): an update through a lora_A of "
                   "zeros is zero")
            fixes = ["resave-adapter"]
        else:
            why = ("the saved tensors did not load into the adapter's layers (their names do not match the base "
                   "model's modules: a different base, or target_modules that differ)")
            fixes = []
        evidence["saved"] = saved
        return finding("export-adapter-no-effect", "the saved adapter has no effect: reloaded, it is the base model",
                       f"The trained adapter changes the logits (max |difference| "
                       f"{facts.comparisons['effect'].max_logit_diff:.3g} against the adapter disabled), but the adapter "
                       f"loaded back from {facts.path} changes nothing: {why}.", evidence, fixes=fixes)
    return None


@rule("export-merge-differs", "error")
def export_merge_differs(ctx):
    """The merged model computes something else than the trained adapter: merged into a quantised or lower-precision base."""
    facts = _compared(ctx)
    if facts is None or facts.kind == "adapter" or not facts.trained_is_peft or _trained_dead(facts):
        return None
    artifact, effect = facts.comparisons["artifact"], facts.comparisons["effect"]
    weights = facts.merge.get("lost_share")
    if weights is not None:
        # judged on the weights: the logits also differ by the precision each model computes in
        if weights <= FAITHFUL_MERGE:
            return None
        share = weights
    elif artifact.same:
        return None
    else:
        share = artifact.max_logit_diff / effect.max_logit_diff if effect.max_logit_diff else float("inf")
    causes = []
    if facts.base_quantized:
        causes.append("the base is quantised: merge_and_unload() dequantises, adds the delta and quantises again, "
                      "which rounds the adapter's small update away")
    if facts.artifact_dtype in ("bfloat16", "float16") and facts.artifact_dtype != "float32":
        causes.append(f"the merged weights are {facts.artifact_dtype}: adding the adapter's small delta to "
                      f"{facts.artifact_dtype} weights rounds much of it away")
    if facts.merge.get("shared_weight"):
        causes.append(f"{facts.merge['shared_weight'][0]} shares its weight with an adapted layer (tied input and "
                      "output embeddings): merge_and_unload() writes the adapter's update into the one weight, where "
                      "the model trained applied it to the adapted layer alone")
    why = "; ".join(causes) or "the merged weights differ from base + adapter"
    severity = "error" if share >= LOST_SHARE or artifact.top1_agreement < 1.0 else "warning"
    where = f"the merged model in {facts.path}" if facts.path else "the merged model"
    if weights is not None:
        title = f"{where} lost {100 * share:.0f}% of the adapter's weight update"
        measured = (f"||merged - (base + adapter)|| is {100 * share:.0f}% of ||adapter update|| over "
                    f"{facts.merge['layers']} LoRA layer(s) (worst: {', '.join(facts.merge['worst'])}); "
                    f"{artifact.line()}")
    else:
        title = f"{where} differs from the trained adapter ({100 * share:.0f}% of the adapter's effect)"
        measured = f"{artifact.line()}; the adapter itself moves the logits by {effect.max_logit_diff:.3g}"
    half = facts.artifact_dtype in ("bfloat16", "float16")
    advice = ("Merge into an unquantised float32 copy of the base, then cast." if facts.base_quantized else
              "Merge into a float32 copy of the base and serve it in float32"
              + (f" (cast to {facts.artifact_dtype}, the merged weights round the update away again)" if half else "")
              + ", or serve the base with the adapter unmerged.")
    if facts.merge.get("shared_weight"):
        advice = ("No merge of this adapter can be faithful while the embeddings are tied: serve the base with the "
                  "adapter unmerged, or untie them (tie_word_embeddings=False, lm_head a copy) before training.")
    return finding(
        "export-merge-differs", title, f"{measured}. {why.capitalize()}. {advice}",
        {"comparisons": _numbers(facts), "share_of_adapter_effect": share, "merged_dtype": facts.artifact_dtype,
         "trained_dtype": facts.trained_dtype, "base_quantized": facts.base_quantized, "merge": facts.merge},
        fixes=[] if facts.merge.get("shared_weight") else ["merge-in-fp32"], severity=severity)


@rule("export-embeddings-not-saved", "error")
def export_embeddings_not_saved(ctx):
    """Resized or trained embeddings that the saved adapter does not carry: base + adapter reloads other embedding rows."""
    facts = _compared(ctx)
    if facts is None or facts.kind != "adapter" or _saved_adapter_dead(facts) or _trained_dead(facts):
        return None
    emb, _ = _not_saved(facts)
    if not emb and not _vocab_changed(facts):
        return None
    vocab = facts.comparisons["artifact"].vocab
    resized = facts.base_vocab is not None and vocab[0] != facts.base_vocab
    rows = {n: {k: v for k, v in how.items() if k in ("shape", "rows", "row_count", "rows_total", "max_diff")}
            for n, how in emb.items()}
    what = (f"the embeddings were resized from {facts.base_vocab} to {vocab[0]} tokens" if resized
            else "the embedding matrices were trained")
    return finding(
        "export-embeddings-not-saved", f"{what.split(': ')[0]}, but the saved adapter does not carry them",
        f"{what.capitalize()} and the adapter file has no embedding weights (saved: "
        f"{facts.saved.get('embedding_keys') or 'none'}), so base + adapter reloads with "
        f"{'the base vocabulary of ' + str(vocab[1]) + ' tokens' if vocab[0] != vocab[1] else 'other rows'} "
        f"({', '.join(rows) or 'the output vocabulary'} differ). {facts.comparisons['artifact'].line()}. "
        "Save with save_embedding_layers=True, or name the embeddings in modules_to_save.",
        {"comparisons": _numbers(facts), "base_vocab": facts.base_vocab, "trained_vocab": vocab[0],
         "reloaded_vocab": vocab[1], "differing": rows, "saved_embedding_keys": facts.saved.get("embedding_keys")},
        fixes=["save-embedding-layers"])


@rule("export-trained-modules-not-saved", "error")
def export_trained_modules_not_saved(ctx):
    """Weights trained outside the adapter (requires_grad set by hand, not in modules_to_save) that save_pretrained left out."""
    facts = _compared(ctx)
    if facts is None or facts.kind != "adapter" or _trained_dead(facts):
        return None
    _, other = _not_saved(facts)
    if not other:
        return None
    modules = sorted({n.rsplit(".", 1)[0] for n in other})
    short = sorted({m.split(".")[-1] for m in modules})
    return finding(
        "export-trained-modules-not-saved", f"{len(other)} trained weight(s) outside the adapter were not saved: "
        f"{', '.join(modules[:3])}{' ...' if len(modules) > 3 else ''}",
        "These parameters changed during training but are not adapter weights, and modules_to_save does not name "
        f"them, so save_pretrained wrote only the LoRA matrices: base + adapter reloads them as they were before "
        f"training. {facts.comparisons['artifact'].line()}. Name them in LoraConfig(modules_to_save={short!r}) and "
        "train again (PEFT then trains and saves a copy), rather than setting requires_grad on base weights.",
        {"parameters": capped(other), "modules_to_save": facts.lora.get("modules_to_save"),
         "comparisons": _numbers(facts)})


@rule("export-tied-weights-broken", "warning")
def export_tied_weights_broken(ctx):
    """Input and output embeddings tied in the trained model but not in the reloaded artifact (or the other way round)."""
    facts = _compared(ctx)
    if facts is None or not _ties_broken(facts) or facts.comparisons["artifact"].same:
        return None
    trained, reloaded = facts.ties["trained"], facts.ties["reloaded"]
    return finding(
        "export-tied-weights-broken",
        f"the embeddings are {'tied' if trained else 'untied'} in the trained model, "
        f"{'tied' if reloaded else 'untied'} in the reloaded one",
        "The reloaded artifact shares (or stops sharing) the matrix between the input embeddings and the output "
        "head, unlike the model trained: one side's trained values are lost, or overwrite the other. Save both "
        "sides (save_embedding_layers=True), and keep config.tie_word_embeddings saying what the weights are.",
        {"ties": facts.ties, "comparisons": _numbers(facts)}, fixes=["save-embedding-layers"])


@rule("export-reload-differs", "error")
def export_reload_differs(ctx):
    """The artifact, loaded back as users load it, gives other logits than the trained model, for no reason the other export rules name."""
    facts = _compared(ctx)
    if facts is None or facts.comparisons["artifact"].same or _explained(facts):
        return None
    lora_diffs = {n: h for n, h in facts.differing.items() if "lora_" in n}
    why = (f"the saved adapter weights are not the trained ones ({len(lora_diffs)} LoRA tensors differ: saved at "
           "another step, or from another copy)" if lora_diffs else "no saved file or parameter explains it")
    return finding(
        "export-reload-differs", "the reloaded artifact is not the model trained",
        f"{facts.comparisons['artifact'].line()}: {why}.",
        {"comparisons": _numbers(facts), "differing": capped(facts.differing), "load": facts.load},
        fixes=["resave-adapter"] if lora_diffs else [])


@rule("export-tokenizer-not-saved", "warning")
def export_tokenizer_not_saved(ctx):
    """No tokenizer beside the exported model, or one with another vocabulary than training used."""
    facts = _facts(ctx)
    tok = facts.tokenizer if facts is not None else {}
    if not tok:
        return None
    if not tok.get("files"):
        return finding(
            "export-tokenizer-not-saved", f"no tokenizer was saved in {facts.path}",
            "The folder has the weights but no tokenizer files: whoever loads it takes the base model's tokenizer, "
            "without the tokens, pad token and chat template training used (AutoPeftModelForCausalLM also resizes "
            "the embeddings only from a tokenizer saved beside the adapter).", {"tokenizer": tok},
            fixes=["save-tokenizer"])
    if tok.get("saved_vocab") is not None and tok["saved_vocab"] != tok.get("training_vocab"):
        return finding(
            "export-tokenizer-not-saved", f"the saved tokenizer has {tok['saved_vocab']} tokens, training used "
            f"{tok['training_vocab']}",
            "The tokenizer in the folder is not the one training used: token ids mean other words.",
            {"tokenizer": tok}, fixes=["save-tokenizer"])
    return None


@rule("export-chat-template-not-saved", "error")
def export_chat_template_not_saved(ctx):
    """The tokenizer saved beside the model has no chat template, or another one than training rendered with."""
    facts = _facts(ctx)
    tok = facts.tokenizer if facts is not None else {}
    if not tok or not tok.get("files") or not tok.get("training_template") or "saved_template" not in tok:
        return None
    if not tok["saved_template"]:
        return finding(
            "export-chat-template-not-saved", "the tokenizer was saved without a chat template",
            "Training rendered conversations with a chat template, but the tokenizer in the folder has none: "
            "apply_chat_template fails there, and a server falls back to a default that is not the format the model "
            "learned.", {"tokenizer": tok}, fixes=["save-tokenizer"])
    diff = tok.get("template_difference")
    if diff is None:
        return None
    return finding(
        "export-chat-template-not-saved",
        f"the saved chat template renders differently from token {diff['position']}: {diff['served']!r} where "
        f"training had {diff['trained']!r}",
        f"A probe conversation rendered with the saved template departs from training's rendering at token "
        f"{diff['position']} (after {' '.join(map(str, diff['before']))!r}): served prompts are not the format "
        "the model learned. Save the template training used.", {"tokenizer": tok}, fixes=["save-tokenizer"])
