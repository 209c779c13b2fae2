"""The trainer's tokenizer, read in one place: processing_class, a collator's tokenizer, a processor's tokenizer."""
from __future__ import annotations

from audit_helpers import make_args, make_trainer

from nbguard.auditor.context import AuditContext
from nbguard.introspect.tokenizers import tokenizer_of
from nbguard.introspect.trl import eos_token_id
from nbguard.testing import tiny_llama, word_tokenizer
from nbguard.verifier.reaudit import build_shadow


def test_a_trainers_processing_class_is_its_tokenizer_and_a_processor_gives_its_own(tmp_path):
    from transformers import Wav2Vec2FeatureExtractor, Wav2Vec2Processor

    tok = word_tokenizer()
    trainer = make_trainer(tiny_llama(), make_args(tmp_path))
    assert trainer.processing_class is None and tokenizer_of(trainer) is None and tokenizer_of(None) is None
    trainer.processing_class = tok
    assert tokenizer_of(trainer) is tok and eos_token_id(trainer) == tok.eos_token_id
    assert AuditContext(trainer=trainer).tokenizer is tok
    assert build_shadow(trainer, trainer.model, trainer.args, config=False).tokenizer is not tok  # the shadow's copy
    # a multimodal trainer's processing_class is a processor: the tokenizer is the one it carries
    trainer.processing_class = Wav2Vec2Processor(feature_extractor=Wav2Vec2FeatureExtractor(), tokenizer=tok)
    assert tokenizer_of(trainer) is tok and AuditContext(trainer=trainer).tokenizer is tok


def test_without_processing_class_the_tokenizer_attribute_counts_as_on_a_collator(tmp_path):
    from transformers import DataCollatorForLanguageModeling

    tok = word_tokenizer()
    collator = DataCollatorForLanguageModeling(tokenizer=tok, mlm=False)
    assert tokenizer_of(collator) is tok
    trainer = make_trainer(tiny_llama(), make_args(tmp_path))
    trainer.data_collator = collator
    assert AuditContext(trainer=trainer).tokenizer is tok  # the trainer holds none: its collator's
    # where processing_class exists, tokenizer is never read (transformers 4.46+: a deprecated property that
    # logs a warning into the user's output)
    vars(trainer)["tokenizer"] = word_tokenizer()  # (on the instance: 4.46+'s property has a setter)
    assert tokenizer_of(trainer) is None
