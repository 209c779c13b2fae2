"""Known warnings explained under the cell, once each, without swallowing anything (issue 13 item 14).

Where the current library emits the warning on CPU it is raised for real: torch.utils.checkpoint
on a checkpointed model with frozen embeddings, bitsandbytes' Linear4bit fed fp16. The trl and
transformers releases installed here no longer emit the response-key and Gemma 2 warnings (trl
dropped DataCollatorForCompletionOnlyLM; transformers 5 dropped the Gemma 2 recommendation), so
their historical text is emitted through the same channel the library used: ``warnings.warn(...,
UserWarning)`` for trl, ``logger.warning_once`` on the module's transformers logger for Gemma 2.
"""
from __future__ import annotations

import logging
import warnings

import pytest
from IPython.core.interactiveshell import InteractiveShell
from notebook_helpers import run

from nbguard.explainer import WARNING_SIGNATURES, diagnose_warning
from nbguard.notebook.cellwarnings import _Handler
from nbguard.session import SESSION

RESPONSE_KEY = ("Could not find response key `### Response:` in the following instance: ### Question: 2+2? "
                "The answer is 4. This instance will be ignored in loss calculation. Note, if this happens often, "
                "consider increasing the `max_length`.")
GEMMA2 = ("It is strongly recommended to train Gemma2 models with the `eager` attention implementation instead of "
          "`flash_attention_2`. Use `eager` with `AutoModelForCausalLM.from_pretrained('<path-to-checkpoint>', "
          "attn_implementation='eager')`.")

CHECKPOINTED = """
import torch
from nbguard.testing import tiny_llama, tiny_batch
model = tiny_llama()
model.model.embed_tokens.weight.requires_grad_({embed_grad})  # frozen embeddings, as under LoRA
model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={{"use_reentrant": True}})
if hasattr(model, "_require_grads_hook"):  # transformers 5 turns it on by itself; PEFT set-ups lose it
    model.disable_input_require_grads()
model.train()
model(**tiny_batch()).loss
"""
LINEAR4BIT = """
import torch, bitsandbytes as bnb
layer = bnb.nn.Linear4bit(64, 64, bias=False, compute_dtype=None, quant_type="nf4").to("cpu")
layer(torch.randn(2, 64, dtype=torch.{dtype}))
"""


@pytest.fixture
def seen_by_user():
    """The user's own ``showwarning`` (what they would see), installed BEFORE nbguard loads."""
    ip = InteractiveShell.instance()
    before = set(ip.user_ns)
    shown: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = lambda message, category, *a, **k: shown.append(f"{category.__name__}: {message}")
        run(ip, "%load_ext nbguard")
        yield ip, shown
        run(ip, "%unload_ext nbguard")
    for name in set(ip.user_ns) - before:
        del ip.user_ns[name]


def _signatures(cell) -> list[str]:
    return [d["diagnoses"][0]["signature"] for d in cell.docs if d["kind"] == "diagnosis"]


def test_real_checkpoint_warning_is_shown_and_explained_once(seen_by_user):
    ip, shown = seen_by_user
    cell = run(ip, CHECKPOINTED.format(embed_grad=False))
    assert cell.error is None, cell.stderr
    assert any("None of the inputs have requires_grad=True. Gradients will be None" in s for s in shown)
    assert _signatures(cell) == ["checkpoint-inputs-no-grad"]
    [doc] = cell.docs
    assert "enable-input-require-grads" in doc["fix_cells"] and "model.enable_input_require_grads" in \
        doc["fix_cells"]["enable-input-require-grads"]["code"]
    assert doc["diagnoses"][0]["exception"].startswith("UserWarning: None of the inputs")
    shown.clear()
    again = run(ip, "model(**tiny_batch()).loss")
    assert shown and _signatures(again) == []  # the user still sees it; nbguard explained it once
    assert [d.signature for d in SESSION.diagnoses] == ["checkpoint-inputs-no-grad"]


def test_checkpointing_with_inputs_that_need_grad_gives_no_warning_and_no_card(seen_by_user):
    ip, shown = seen_by_user
    cell = run(ip, CHECKPOINTED.format(embed_grad=True))
    assert cell.error is None and not any("requires_grad" in s for s in shown) and _signatures(cell) == []


def test_real_linear4bit_input_type_warning_is_explained(seen_by_user):
    pytest.importorskip("bitsandbytes")
    ip, _shown = seen_by_user
    cell = run(ip, LINEAR4BIT.format(dtype="float16"))
    assert cell.error is None, cell.stderr
    assert _signatures(cell) == ["linear4bit-input-dtype"]
    evidence = cell.docs[0]["diagnoses"][0]["evidence"]
    assert evidence == {"warning_origin": "bitsandbytes.nn.modules", "input_dtype": "torch.float16",
                        "compute_dtype": "torch.float32"}


def test_linear4bit_fed_its_compute_dtype_gives_no_card(seen_by_user):
    pytest.importorskip("bitsandbytes")
    ip, _shown = seen_by_user
    assert _signatures(run(ip, LINEAR4BIT.format(dtype="float32"))) == []


def test_response_key_warning_through_warnings_is_explained(seen_by_user):
    ip, shown = seen_by_user
    cell = run(ip, f"import warnings\nwarnings.warn({RESPONSE_KEY!r}, UserWarning)")
    assert [s for s in shown if s.startswith("UserWarning")] == [f"UserWarning: {RESPONSE_KEY}"]  # seen as before
    assert _signatures(cell) == ["response-key-not-found"]
    assert cell.docs[0]["diagnoses"][0]["evidence"]["response_key"] == "### Response:"


def test_gemma2_recommendation_through_the_transformers_logger_is_explained(seen_by_user):
    ip, _shown = seen_by_user
    records: list[str] = []
    users_handler = logging.Handler()
    users_handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("transformers")
    logger.addHandler(users_handler)
    try:
        cell = run(ip, "from transformers.utils import logging as hf_logging\n"
                       "hf_logging.get_logger('transformers.models.gemma2.modeling_gemma2')"
                       f".warning_once({GEMMA2!r})")
    finally:
        logger.removeHandler(users_handler)
    assert records == [GEMMA2]  # every other handler still gets the record
    assert _signatures(cell) == ["gemma2-eager-attention"]
    assert cell.docs[0]["diagnoses"][0]["evidence"]["attn_implementation"] == "flash_attention_2"


def test_an_unknown_warning_is_shown_and_not_explained(seen_by_user):
    ip, shown = seen_by_user
    cell = run(ip, "import warnings\nwarnings.warn('Could not find the file. This instance is fine.', UserWarning)")
    assert len(shown) == 1 and _signatures(cell) == []


def test_a_warning_the_filters_hide_is_not_explained(seen_by_user):
    ip, shown = seen_by_user
    cell = run(ip, f"import warnings\nwith warnings.catch_warnings():\n    warnings.simplefilter('ignore')\n"
                   f"    warnings.warn({RESPONSE_KEY!r}, UserWarning)")
    assert shown == [] and _signatures(cell) == []  # nbguard explains what the user sees, nothing more


# -- the channel where nbguard's handler would be the only one ---------------------------------------
def test_the_handler_hands_a_record_to_last_resort_when_it_is_the_only_handler(monkeypatch):
    seen, fallback = [], []
    monkeypatch.setattr(logging, "lastResort", type("Fallback", (logging.Handler,), {
        "emit": lambda self, record: fallback.append(record.getMessage())})(logging.WARNING))
    logger = logging.getLogger("nbguard-test-lonely")
    logger.propagate = False
    handler = _Handler(lambda text, origin: seen.append((text, origin)))
    logger.addHandler(handler)
    try:
        logger.warning("Input type into Linear4bit is torch.float16")
        assert seen == [("Input type into Linear4bit is torch.float16", "nbguard-test-lonely")]
        assert fallback == ["Input type into Linear4bit is torch.float16"]  # what Python prints without us
        other = logging.Handler()
        other.emit = lambda record: None
        logger.addHandler(other)
        logger.warning("second")
        assert fallback == ["Input type into Linear4bit is torch.float16"]  # someone else shows it now
    finally:
        logger.handlers.clear()


# -- the signatures themselves ------------------------------------------------------------------------
@pytest.mark.parametrize("text, origin, signature", [
    (RESPONSE_KEY, "UserWarning", "response-key-not-found"),
    ("None of the inputs have requires_grad=True. Gradients will be None", "UserWarning", "checkpoint-inputs-no-grad"),
    (GEMMA2, "transformers.models.gemma2.modeling_gemma2", "gemma2-eager-attention"),
    ("Input type into Linear4bit is torch.float16, but bnb_4bit_compute_dtype=torch.float32 (default). "
     "This will lead to slow inference.", "bitsandbytes.nn.modules", "linear4bit-input-dtype"),
])
def test_each_signature_matches_its_warning(text, origin, signature):
    diagnosis = diagnose_warning(text, origin)
    assert diagnosis is not None and diagnosis.signature == signature and diagnosis.detail


@pytest.mark.parametrize("text", [
    "Could not find response key in the config",  # no "ignored in loss calculation"
    "None of the inputs have requires_grad=True.",  # half of the message
    "It is strongly recommended to pass the `sampling_rate` argument",
    "Input type into Linear4bit is torch.float16",  # no compute dtype named
    "`torch.nn.functional.scaled_dot_product_attention` does not support `output_attentions=True`.",
])
def test_near_misses_are_not_matched(text):
    assert diagnose_warning(text, "UserWarning") is None


def test_every_signature_names_a_real_channel():
    assert set(WARNING_SIGNATURES) == {"response-key-not-found", "checkpoint-inputs-no-grad",
                                       "gemma2-eager-attention", "linear4bit-input-dtype",
                                       "generation-keyword-missing", "mistral-regex-warning",  # issue 21's
                                       "prompt-not-a-prefix", "cuda-arch-not-compatible"}
    assert {s.source for s in WARNING_SIGNATURES.values()} == {"warnings", "logging:transformers",
                                                               "logging:bitsandbytes", "logging:trl"}
