"""The reference pages, generated from nbguard's registries at docs build time so they cannot drift.

mkdocs-gen-files runs this file during `mkdocs build`: every audit rule, fix, error and warning
signature, watch event kind and magic is read from the registry the code uses, and a registered
entry without a description fails the build. The executed notebooks (build/demo, build/notebooks,
written by notebooks/run.py) become pages too. tests/test_docs.py imports ``pages()`` to check that
every registered id has its entry.
"""
from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # the checkout's nbguard, whether or not it is installed
    sys.path.insert(0, str(REPO))

# Descriptions for the registries whose entries are plain ids or undocumented matcher functions:
# the error and warning signatures (a docstring on the matcher wins when it has one), the event
# kinds and the causes. tests/test_docs.py fails when a registered id has none.
SIGNATURE_NOTES = {
    "anomaly-nan-output": "`torch.autograd.detect_anomaly` names the backward function that returned NaN "
                          "(\"Function 'CompiledFunctionBackward' returned nan values in its 0th output\"); "
                          "it says where in autograd, not which module: run `%nanwatch` to localise.",
    "cache-float-crash": "transformers 4.50 evaluating under bf16/fp16 casts the KV cache with `.float()`: "
                         "\"'HybridCache' object has no attribute 'float'\".",
    "fp16-unscale-error": "fp16 mixed precision with half-precision trainable weights: \"Attempting to unscale "
                          "FP16 gradients\", or the bf16 variant on CUDA "
                          "(`\"_amp_foreach_non_finite_check_and_unscale_cuda\" not implemented for 'BFloat16'`).",
    "matmul-dtype-mismatch": "\"expected mat1 and mat2 to have the same dtype\": the cause is read from what the "
                             "model holds (mixed dtypes, a 4-bit compute dtype, a forced-fp32 model, the input), "
                             "so no fix is offered by reflex.",
    "no-grad-input": "\"element 0 of tensors does not require grad\": gradient checkpointing of a PEFT model "
                     "whose inputs need no grad, or a frozen graph.",
    "bf16-unsupported": "\"Your setup doesn't support bf16/gpu\" or \"Bfloat16 is only supported on GPUs with "
                        "compute capability of at least 8.0\": bf16 asked for on a GPU without it.",
    "half-overflow-value": "\"value cannot be converted to type at::Half without overflow\": a value past "
                           "65504 written into an fp16 tensor.",
    "half-op-on-cpu": "`\"addmm_impl_cpu_\" not implemented for 'Half'`: an fp16 model on a CPU runtime.",
    "flash-attention-unsupported": "\"FlashAttention only supports Ampere GPUs or newer\": `flash_attention_2` "
                                   "on a T4, V100 or no GPU.",
    "softcap-unsupported-attention": "\"`sdpa` attention does not support `softcap`\": Gemma 2 logit softcapping "
                                     "with an attention implementation that refuses it.",
    "token-ids-out-of-range": "\"index out of range in self\", \"srcIndex < srcSelectDimSize\" or \"CUDA error: "
                              "device-side assert triggered\" after adding tokens without resizing the embeddings.",
    "sampling-nonfinite-probs": "\"probability tensor contains either inf, nan or element < 0\": generation "
                                "sampled from non-finite logits.",
    "loss-scale-minimum": "The loss scaler hit its minimum: every step overflows fp16, so GradScaler or "
                          "DeepSpeed keeps skipping.",
    "nbguard-stopped": "`nbguard.NonFiniteError`: the watch's `stop` policy stopped a plain loop at a "
                       "non-finite step, with the last good weights kept.",
    "response-key-not-found": "TRL's completion-only collator: \"Could not find response key ... ignored in loss "
                              "calculation\": the rows train on nothing.",
    "checkpoint-inputs-no-grad": "\"None of the inputs have requires_grad=True\" from gradient checkpointing: "
                                 "the adapters get no gradient.",
    "gemma2-eager-attention": "transformers recommends eager attention for Gemma 2 training (softcapping).",
    "linear4bit-input-dtype": "bitsandbytes' \"Input type into Linear4bit is torch.float16, but "
                              "bnb_4bit_compute_dtype=torch.float32\": a slow or mismatched 4-bit compute dtype.",
}
CAUSE_NOTES = {
    "overflow": "A finite input produced a value past the dtype's range (fp16: 65504).",
    "invalid-op": "A finite input produced NaN through an invalid operation (0/0, inf-inf, log of a negative).",
    "nonfinite-parameter": "A parameter was already NaN or Inf before the step.",
    "nonfinite-input": "The batch itself held NaN or Inf.",
    "no-supervised-tokens": "Every label of the loss was ignored (-100): a 0/0 mean.",
    "not-reproducible": "The replay of the step was finite: the step could not be reproduced (what to try next "
                        "is on the event).",
}


def _doc(obj) -> str:
    return inspect.cleandoc(obj.__doc__ or "")


def _fix_ids_named_in(func, fix_ids) -> list[str]:
    """The registered fixes a rule's source names: its fixes, read from the code that offers them."""
    try:
        source = inspect.getsource(func)
    except (OSError, TypeError):
        return []
    return [fix for fix in fix_ids if re.search(rf"[\"']{re.escape(fix)}[\"']", source)]


def _fix_links(fix_ids) -> str:
    return ", ".join(f"[`{fix}`](fixes.md#{fix})" for fix in fix_ids) or "none offered by reflex"


def _require(kind: str, entry: str, text: str) -> str:
    if not text.strip():
        raise ValueError(f"{kind} {entry!r} has no description: write one where it is registered "
                         f"(or in docs/gen_reference.py for signatures)")
    return text


def rules_page() -> str:
    import nbguard.auditor  # noqa: F401  (registers every rule)
    import nbguard.fixes  # noqa: F401
    from nbguard.auditor.registry import RULES
    from nbguard.fixes.registry import FIXES

    lines = ["# Audit rules", "",
             "`nbguard.audit(...)` and `%precision_check` run every rule below; each finding names its rule, "
             "its severity and the fixes to try. Generated from `nbguard.auditor.registry.RULES`; the fixes listed "
             "are those the rule's own code names (a finding may add others its helpers choose for your setup).",
             ""]
    for rule in sorted(RULES.values(), key=lambda r: ({"error": 0, "warning": 1}.get(r.severity.value, 2), r.id)):
        lines += [f"## {rule.id}", "", f"**Severity:** {rule.severity.value}  ",
                  f"**Fixes:** {_fix_links(_fix_ids_named_in(rule.check, FIXES))}", "",
                  _require("audit rule", rule.id, rule.description), ""]
    return "\n".join(lines)


def _options(apply) -> list[str]:
    params = inspect.signature(apply).parameters.values()
    return [f"`{p.name}` (default `{p.default!r}`)" for p in list(params)[1:]
            if p.kind is p.POSITIONAL_OR_KEYWORD or p.kind is p.KEYWORD_ONLY]


def fixes_page() -> str:
    import nbguard.fixes  # noqa: F401
    from nbguard.fixes.registry import FIXES

    lines = ["# Fixes", "",
             "Each fix is an action (`nbguard.fixes.apply(ID, model=..., trainer=..., **options)`, idempotent) and a "
             "cell (`nbguard.fixes.code(ID, ...)`, the same change in plain torch/transformers code). "
             "`%nbguard fix ID [--apply]` does both from a notebook. Generated from `nbguard.fixes.registry.FIXES`.",
             ""]
    for fix in sorted(FIXES.values(), key=lambda f: f.id):
        options = _options(fix.apply)
        lines += [f"## {fix.id}", "", f"**{fix.title}**  ", f"**Acts on:** {fix.needs}  ",
                  f"**Options:** {', '.join(options) if options else 'none'}", "",
                  _require("fix", fix.id, fix.description), ""]
    return "\n".join(lines)


def signatures_page() -> str:
    import nbguard.fixes  # noqa: F401
    from nbguard.explainer.rules import RULES as ERRORS
    from nbguard.explainer.warnings import WARNING_SIGNATURES
    from nbguard.fixes.registry import FIXES

    lines = ["# Error and warning signatures", "",
             "After `%load_ext nbguard`, a known error is followed by a diagnosis card under IPython's own traceback "
             "(`nbguard.explain(exc)` from Python); a known warning that announces a failure is explained once "
             "under the cell, and still shows. Messages are matched tolerantly (quotes, line breaks, spacing as "
             "pasted). Generated from `nbguard.explainer`.", "", "## Errors", ""]
    for signature, func in sorted(ERRORS.items()):
        text = _doc(func) or SIGNATURE_NOTES.get(signature, "")
        lines += [f"### {signature}", "", f"**Fixes:** {_fix_links(_fix_ids_named_in(func, FIXES))}", "",
                  _require("error signature", signature, text), ""]
    lines += ["## Warnings", ""]
    for signature, entry in sorted(WARNING_SIGNATURES.items()):
        text = _doc(entry.match) or SIGNATURE_NOTES.get(signature, "")
        lines += [f"### {signature}", "", f"**Heard on:** `{entry.source}`  ",
                  f"**Fixes:** {_fix_links(_fix_ids_named_in(entry.match, FIXES))}", "",
                  _require("warning signature", signature, text), ""]
    return "\n".join(lines)


def events_page() -> str:
    import nbguard.watcher  # noqa: F401  (imports every detector module, so their kinds are registered)
    from nbguard.document.model import CAUSES, EVENT_KIND_REGISTRY

    lines = ["# Watch events", "",
             "What `nbguard.watch(...)` / `%nanwatch` records, each at one optimizer step (0-based, skipped steps "
             "counted). Generated from the event-kind registry (`nbguard.document.model.EVENT_KIND_REGISTRY`) and `CAUSES`.", "", "## Event kinds", ""]
    for kind, entry in EVENT_KIND_REGISTRY.items():
        text = entry.description[:1].upper() + entry.description[1:] + "."
        if entry.evidence:
            text += " Evidence: " + ", ".join(f"`{key}`" for key in entry.evidence) + "."
        _require("event kind", kind, entry.description)
        lines += [f"### {kind}", "", text, ""]
    lines += ["## Causes", "", "A localised non-finite event names its origins (module, phase, dtype, abs-max of "
              "inputs and outputs) and one cause:", ""]
    for cause in CAUSES:
        lines += [f"### {cause}", "", _require("cause", cause, CAUSE_NOTES.get(cause, "")), ""]
    return "\n".join(lines)


def magics_page() -> str:
    from nbguard.notebook.magics import NbguardMagics

    lines = ["# Magics", "", "`%load_ext nbguard` adds these; `%magic?` shows the same manual in a notebook. "
             "Generated from their `magic_arguments`.", ""]
    names = sorted({name for table in NbguardMagics.magics.values() for name in table.values()})
    for name in names:
        manual = _require("magic", name, _doc(getattr(NbguardMagics, name)))
        manual = manual.removeprefix("::").strip("\n")
        lines += [f"## %{name}", "", "```text", manual, "```", ""]
    return "\n".join(lines)


API_PAGE = """# Python API

The public functions, from their docstrings.

::: nbguard.api.audit

::: nbguard.api.watch

::: nbguard.api.verify

::: nbguard.api.explain

::: nbguard.api.report

::: nbguard.api.callback

::: nbguard.api.lightning_callback

::: nbguard.api.check_export
"""


def pages() -> dict[str, str]:
    """Every generated reference page: path under docs/ -> Markdown."""
    return {
        "reference/rules.md": rules_page(),
        "reference/fixes.md": fixes_page(),
        "reference/signatures.md": signatures_page(),
        "reference/events.md": events_page(),
        "reference/magics.md": magics_page(),
        "reference/api.md": API_PAGE,
    }


NOTEBOOK_BUILDS = ("build/demo", "build/notebooks")  # executed copies, newest first


def notebook_pages() -> dict[str, str | bytes]:
    """The notebooks as Markdown pages (+ their extracted images): the executed copy where
    notebooks/run.py left one, else the committed notebook without outputs."""
    import nbformat
    from nbconvert import MarkdownExporter
    from traitlets.config import Config

    config = Config()
    # nbguard's static HTML, not the live widget (no widget manager in a docs page)
    config.NbConvertBase.display_data_priority = ["text/html", "text/markdown", "image/png", "text/plain"]
    exporter = MarkdownExporter(config=config)
    files: dict[str, str | bytes] = {}
    for source in sorted((REPO / "notebooks").glob("*.ipynb")):
        executed = [REPO / build / source.name for build in NOTEBOOK_BUILDS if (REPO / build / source.name).is_file()]
        path = executed[0] if executed else source
        nb = nbformat.read(path, as_version=4)
        body, resources = exporter.from_notebook_node(nb, resources={"output_files_dir": f"{source.stem}_files"})
        body = re.sub(r"\(([\w.-]+)\.ipynb\)", r"(\1.md)", body)
        note = ("*Executed by `make demo` / `notebooks/run.py`.*" if executed else
                "*Shown without outputs: run `python notebooks/run.py --out build/notebooks notebooks/"
                f"{source.name}` before `make docs` to include them.*")
        files[f"notebooks/{source.stem}.md"] = f"{note}\n\n{body}"
        for name, data in resources.get("outputs", {}).items():
            files[f"notebooks/{name}"] = data
    return files


def _write_with_gen_files() -> None:
    import mkdocs_gen_files

    for path, text in {**pages(), **notebook_pages()}.items():
        with mkdocs_gen_files.open(path, "wb" if isinstance(text, bytes) else "w") as handle:
            handle.write(text)


if __name__ in ("__main__", "<run_path>"):  # mkdocs-gen-files runs it with runpy
    _write_with_gen_files()
