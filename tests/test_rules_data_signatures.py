"""The error signatures of the data, chat-template and configuration rules, each raised by a real library call
(the cuDNN one by its message only: the cuDNN attention backend exists on NVIDIA GPUs only)."""
from __future__ import annotations

import socket
import tempfile
from pathlib import Path

import pytest
import torch
from test_explain import REAL, raised
from test_explain_signatures import CASES

from nbguard.explainer import RULES, diagnose


def _tmp() -> str:
    return tempfile.mkdtemp(prefix="nbguard-sig-")


def assistant_mask_no_generation():
    from chat_helpers import WITHOUT_GENERATION, chat_tokenizer, conversation
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from nbguard.testing import tiny_llama

    SFTTrainer(model=tiny_llama(), processing_class=chat_tokenizer(WITHOUT_GENERATION),
               args=SFTConfig(output_dir=_tmp(), use_cpu=True, report_to=[], assistant_only_loss=True),
               train_dataset=Dataset.from_list([{"messages": conversation()}]))


def model_without_labels():
    from audit_helpers import make_args
    from data_helpers import lm_trainer, ragged_examples, word_tokenizer
    from transformers import DataCollatorWithPadding

    from nbguard.testing import tiny_llama

    tok = word_tokenizer(pad="unk")
    lm_trainer(tiny_llama(), make_args(Path(_tmp())), ragged_examples(4), DataCollatorWithPadding(tok), tok).train()


def classifier_without_pad():
    from transformers import LlamaConfig, LlamaForSequenceClassification

    model = LlamaForSequenceClassification(LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, num_labels=1, pad_token_id=None))
    model(input_ids=torch.ones((2, 5), dtype=torch.long))


def mxfp4_trainer():
    from peft import LoraConfig, get_peft_model
    from test_rules_known_bugs import tiny_gpt_oss
    from transformers import Mxfp4Config, Trainer, TrainingArguments

    peft = get_peft_model(tiny_gpt_oss(Mxfp4Config()), LoraConfig(r=4, target_modules=["q_proj"]))
    Trainer(model=peft, args=TrainingArguments(output_dir=_tmp(), use_cpu=True, report_to=[]))


def ddp_ready_twice():
    """A one-process gloo group is enough: the reducer marks the checkpointed parameters ready twice."""
    import torch.distributed as dist
    from peft import LoraConfig, get_peft_model

    from nbguard.testing import tiny_batch, tiny_llama

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        model = get_peft_model(tiny_llama(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        model.enable_input_require_grads()
        model.train()
        ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
        ddp(**tiny_batch(2, 12)).loss.backward()
    finally:
        dist.destroy_process_group()


def vlm_truncated():
    from vlm_helpers import VLMExamples, collate, tiny_qwen2_vl

    data = VLMExamples(rows=1, max_length=5)
    tiny_qwen2_vl()(**collate([data[0]]))


def cudnn_nan():
    raise RuntimeError("Function 'ScaledDotProductCudnnAttentionBackward0' returned nan values in its 0th output.")


DATA_CASES = {
    "assistant-mask-no-generation": assistant_mask_no_generation,
    "model-returned-no-loss": model_without_labels,
    "classifier-no-pad-token": classifier_without_pad,
    "mxfp4-not-trainable": mxfp4_trainer,
    "ddp-variable-ready-twice": ddp_ready_twice,
    "vlm-image-tokens-mismatch": vlm_truncated,
    "cudnn-attention-backward-nan": cudnn_nan,
}
EXPECTED_FIXES = {
    "classifier-no-pad-token": ["distinct-pad-token", "sync-pad-token-id"],
    "ddp-variable-ready-twice": ["non-reentrant-checkpointing"],
    "cudnn-attention-backward-nan": ["disable-cudnn-sdp"],
}


@pytest.fixture(scope="module")
def errors() -> dict[str, BaseException]:
    return {name: raised(make) for name, make in DATA_CASES.items()}


@pytest.mark.parametrize("signature", sorted(DATA_CASES))
def test_signature_recognises_its_real_error(signature, errors):
    diagnosis = diagnose(errors[signature])
    assert diagnosis is not None and diagnosis.signature == signature, repr(errors[signature])
    assert diagnosis.fixes == EXPECTED_FIXES.get(signature, [])


def test_signatures_are_silent_on_every_other_known_error(errors):
    others = {**{f"old:{k}": raised(v) for k, v in REAL.items()}, **{f"sig:{k}": raised(v) for k, v in CASES.items()},
              **errors}
    for signature in DATA_CASES:
        for name, exc in others.items():
            if name != signature:
                assert RULES[signature](exc) is None, f"{signature} fired on {name}: {exc}"
