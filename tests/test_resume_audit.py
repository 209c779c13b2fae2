"""nbguard.audit(trainer=..., resume_from_checkpoint=PATH) on checkpoints a real Trainer run wrote (save_steps):
flagged before trainer.train(resume_from_checkpoint=PATH) runs."""
from __future__ import annotations

import os
import warnings

import pytest

import nbguard
from nbguard.testing import TinyDataset, tiny_llama

pytestmark = pytest.mark.filterwarnings("ignore")
RESUME_RULES = {"resume-checkpoint-incomplete", "resume-batch-changed", "resume-lr-jump", "resume-model-mismatch",
                "checkpoint-pickle-runs-code"}


def trainer_for(out, model=None, **overrides):
    from transformers import Trainer, TrainingArguments

    options = dict(output_dir=str(out), use_cpu=True, report_to=[], save_strategy="steps", save_steps=2, max_steps=4,
                   per_device_train_batch_size=4, logging_steps=1, disable_tqdm=True, learning_rate=1e-3)
    options.update(overrides)
    return Trainer(model=model if model is not None else tiny_llama(), args=TrainingArguments(**options),
                   train_dataset=TinyDataset(16, 16))


def _train(trainer):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()


@pytest.fixture
def checkpoint(tmp_path):
    trainer = trainer_for(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    return tmp_path / "checkpoint-2"


def resume_rules(result) -> set[str]:
    return {f.rule for f in result.findings} & RESUME_RULES


def test_an_intact_checkpoint_with_the_same_arguments_is_quiet(tmp_path, checkpoint):
    result = nbguard.audit(trainer=trainer_for(tmp_path), resume_from_checkpoint=str(checkpoint))
    assert resume_rules(result) == set()
    assert nbguard.audit(trainer=trainer_for(tmp_path), resume_from_checkpoint=True).finding(
        "resume-checkpoint-incomplete") is None  # True: the last checkpoint in output_dir, as the Trainer reads it


def test_a_checkpoint_without_optimizer_pt_is_flagged_before_training(tmp_path, checkpoint):
    os.remove(checkpoint / "optimizer.pt")
    result = nbguard.audit(trainer=trainer_for(tmp_path), resume_from_checkpoint=str(checkpoint))
    f = result.finding("resume-checkpoint-incomplete")
    assert f is not None and "optimizer.pt" in f.title and "fresh AdamW moments" in f.detail
    assert f.evidence["missing"] == ["optimizer.pt"]
    assert resume_rules(result) == {"resume-checkpoint-incomplete"}


def test_a_truncated_scheduler_is_flagged_as_unloadable(tmp_path, checkpoint):
    data = (checkpoint / "scheduler.pt").read_bytes()
    (checkpoint / "scheduler.pt").write_bytes(data[: len(data) // 2])  # a save cut off by a full disk
    f = nbguard.audit(trainer=trainer_for(tmp_path), resume_from_checkpoint=str(checkpoint)).finding(
        "resume-checkpoint-incomplete")
    assert f is not None and "scheduler.pt" in f.evidence["unreadable"]


def test_a_changed_batch_size_is_flagged(tmp_path, checkpoint):
    result = nbguard.audit(trainer=trainer_for(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=2),
                           resume_from_checkpoint=str(checkpoint))
    f = result.finding("resume-batch-changed")
    assert f is not None
    assert f.evidence["changed"] == {"per_device_train_batch_size": [4, 2], "gradient_accumulation_steps": [1, 2]}


class _RunsCode:
    """What a poisoned checkpoint's pickle holds: unpickling it calls os.system."""

    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


@pytest.mark.parametrize("zip_format", [True, False], ids=["zip", "legacy"])
def test_auditing_a_poisoned_checkpoint_runs_none_of_its_pickle(tmp_path, checkpoint, zip_format):
    import torch

    marker = tmp_path / "ran"
    # the arguments' fields beside the trap, as an attacker would keep the checkpoint looking normal
    torch.save({"trap": _RunsCode(f"touch {marker}"), "per_device_train_batch_size": 4},
               checkpoint / "training_args.bin", _use_new_zipfile_serialization=zip_format)
    result = nbguard.audit(trainer=trainer_for(tmp_path), resume_from_checkpoint=str(checkpoint))
    assert not marker.exists()
    f = result.finding("checkpoint-pickle-runs-code")
    assert f is not None and f.evidence["callables"] == [f"{os.system.__module__}.system"]
    assert "weights_only=False" in f.detail and str(checkpoint) in f.detail
    assert resume_rules(result) == {"checkpoint-pickle-runs-code"}  # the rest of the checkpoint is intact


def test_a_longer_schedule_makes_the_learning_rate_jump(tmp_path, checkpoint):
    result = nbguard.audit(trainer=trainer_for(tmp_path, max_steps=20), resume_from_checkpoint=str(checkpoint))
    f = result.finding("resume-lr-jump")
    assert f is not None
    # linear decay: after 2 of 4 steps the run was at half the peak; rebuilt for 20 steps it is at 90%
    assert f.evidence["checkpoint_lr"] == pytest.approx(5e-4) and f.evidence["resumed_lr"] == pytest.approx(9e-4)
    assert "max_steps is 20 now, 4 in the checkpoint" in f.detail


def test_bad_checkpoint_arguments_say_what_to_pass(tmp_path):
    trainer = trainer_for(tmp_path)
    with pytest.raises(ValueError, match="does not exist"):
        nbguard.audit(trainer=trainer, resume_from_checkpoint=str(tmp_path / "checkpoint-9"))
    with pytest.raises(ValueError, match="has no checkpoint-"):
        nbguard.audit(trainer=trainer, resume_from_checkpoint=True)
    with pytest.raises(TypeError, match="must be a checkpoint folder"):
        nbguard.audit(trainer=trainer, resume_from_checkpoint=3)


# ---- the model built for the resume (resume-model-mismatch) -------------------------------------------------

def test_a_model_built_without_the_resized_embeddings_is_flagged_and_the_resume_really_fails(tmp_path):
    """The first run resized the embeddings (new tokens); the resume builds the model from the base
    config again: the saved embed_tokens and lm_head have another shape, and the Trainer's load raises."""
    resized = tiny_llama()
    resized.resize_token_embeddings(136)
    _train(trainer_for(tmp_path, model=resized))
    checkpoint = tmp_path / "checkpoint-2"
    result = nbguard.audit(trainer=trainer_for(tmp_path), resume_from_checkpoint=str(checkpoint))
    f = result.finding("resume-model-mismatch")
    assert f is not None and f.severity == "error"
    assert set(f.evidence["reshaped"]) == {"model.embed_tokens.weight", "lm_head.weight"}
    assert f.evidence["reshaped"]["model.embed_tokens.weight"] == [[136, 64], [128, 64]]
    assert f.evidence["missing"] == [] and f.evidence["unexpected"] == []
    with pytest.raises(RuntimeError, match="size mismatch"):  # what the finding says the resume would do
        _train_resumed(trainer_for(tmp_path), checkpoint)
    # the model built as the first run built it: quiet
    again = tiny_llama()
    again.resize_token_embeddings(136)
    assert nbguard.audit(trainer=trainer_for(tmp_path, model=again),
                         resume_from_checkpoint=str(checkpoint)).finding("resume-model-mismatch") is None


def test_a_deeper_model_keeps_layers_the_checkpoint_lacks_at_their_init_and_is_flagged(tmp_path, checkpoint):
    deeper = tiny_llama(num_hidden_layers=3)
    f = nbguard.audit(trainer=trainer_for(tmp_path, model=deeper), resume_from_checkpoint=str(checkpoint)).finding(
        "resume-model-mismatch")
    assert f is not None
    assert f.evidence["missing_count"] == sum(1 for k in deeper.state_dict() if k.startswith("model.layers.2."))
    assert all(k.startswith("model.layers.2.") for k in f.evidence["missing"])
    assert "strict=False" in f.detail


def _train_resumed(trainer, checkpoint):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train(resume_from_checkpoint=str(checkpoint))


def _lora(base_dir, r=4):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_dir))
    return get_peft_model(base, LoraConfig(r=r, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))


@pytest.fixture
def lora_checkpoint(tmp_path):
    """A LoRA run on the base saved in base_a (its checkpoint-2 holds the adapter), and another base in base_b."""
    for name, seed in (("base_a", 0), ("base_b", 1)):
        tiny_llama(seed=seed).save_pretrained(tmp_path / name)
    _train(trainer_for(tmp_path / "run", model=_lora(tmp_path / "base_a")))
    return tmp_path / "run" / "checkpoint-2"


def test_an_adapter_resumed_on_the_base_it_was_trained_on_is_quiet(tmp_path, lora_checkpoint):
    result = nbguard.audit(trainer=trainer_for(tmp_path / "run", model=_lora(tmp_path / "base_a")),
                           resume_from_checkpoint=str(lora_checkpoint))
    assert result.finding("resume-model-mismatch") is None


def test_an_adapter_resumed_on_another_base_path_is_flagged_with_both_paths(tmp_path, lora_checkpoint):
    result = nbguard.audit(trainer=trainer_for(tmp_path / "run", model=_lora(tmp_path / "base_b")),
                           resume_from_checkpoint=str(lora_checkpoint))
    f = result.finding("resume-model-mismatch")
    assert f is not None
    assert f.evidence["adapter_differences"] == {
        "base_model_name_or_path": [str(tmp_path / "base_a"), str(tmp_path / "base_b")]}
    assert f.evidence["reshaped"] == {} and f.evidence["missing"] == []  # same shapes: only the path tells


def test_an_adapter_resumed_with_another_rank_is_flagged(tmp_path, lora_checkpoint):
    result = nbguard.audit(trainer=trainer_for(tmp_path / "run", model=_lora(tmp_path / "base_a", r=8)),
                           resume_from_checkpoint=str(lora_checkpoint))
    f = result.finding("resume-model-mismatch")
    assert f is not None and f.evidence["adapter_differences"]["r"] == [4, 8]
    assert f.evidence["reshaped"] and all(".lora_" in k for k in f.evidence["reshaped"])


def test_a_full_model_resumed_from_an_adapter_checkpoint_is_flagged(tmp_path, lora_checkpoint):
    f = nbguard.audit(trainer=trainer_for(tmp_path / "run"), resume_from_checkpoint=str(lora_checkpoint)).finding(
        "resume-model-mismatch")
    assert f is not None and f.evidence["adapter_checkpoint"] is True
    assert "the checkpoint holds an adapter and the model has none" in f.detail
